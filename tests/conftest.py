"""Fixtures shared by the test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """One torch thread for every test: the models are tiny, so one thread is as fast, and much faster when other
    processes compete for the cores (a second thread spinning on a loaded core made a test of many small forwards six
    times slower). A test that needs more threads sets them itself."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def fused_path_on_cpu(monkeypatch):
    """Run the expand backend's CUDA code path (SDPA kernel choice, aligned masks) on CPU tensors."""
    from shared_prefix_logps.backends import expand, sdpa_kernels

    monkeypatch.setattr(expand, "_FUSED_PATH_DEVICES", expand._FUSED_PATH_DEVICES | {"cpu"})
    sdpa_kernels.clear_cache()
    yield
    sdpa_kernels.clear_cache()
