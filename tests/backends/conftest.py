"""Fixtures of the backend tests."""

from __future__ import annotations

import pytest
from support.graph_counter import allow_flex_backward_on_cpu, compile_flex_on_cpu


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """Compile the flex path on CPU with a counting backend, and allow its backward there."""
    return compile_flex_on_cpu(monkeypatch)


@pytest.fixture
def flash_reference_kernels():
    """Run backend='flash' on the pure-torch reference of flash-attn's varlen kernels (any device, any dtype)."""
    from support.flash_reference import REFERENCE

    from shared_prefix_logps.backends.flash_kernels import substituted

    with substituted(REFERENCE) as kernels:
        yield kernels


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """Allow flex_attention's (eager) backward on CPU, for layers the flash backend hands to flex."""
    allow_flex_backward_on_cpu(monkeypatch)
