"""Fixtures of the backend tests."""

from __future__ import annotations

import pytest
from support.graph_counter import GraphCounter

from shared_prefix_logps.backends import flex


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """Compile the flex path on CPU with a counting backend, and allow its backward there."""
    import torch.nn.attention.flex_attention as flex_module

    counter = GraphCounter()
    monkeypatch.setitem(flex._COMPILE_BACKENDS, "cpu", counter)
    monkeypatch.setattr(flex, "_BACKWARD_DEVICES", flex._BACKWARD_DEVICES | {"cpu"})
    validate = flex_module._validate_device

    def validate_without_cpu_backward_refusal(query, key, value):
        if query.device.type != "cpu":
            validate(query, key, value)

    monkeypatch.setattr(flex_module, "_validate_device", validate_without_cpu_backward_refusal)
    return counter


@pytest.fixture
def flash_reference_kernels():
    """Run backend='flash' on the pure-torch reference of flash-attn's varlen kernels (any device, any dtype)."""
    from shared_prefix_logps.backends.flash_kernels import substituted

    with substituted() as kernels:
        yield kernels


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """Allow flex_attention's (eager) backward on CPU, for layers the flash backend hands to flex."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex, "_BACKWARD_DEVICES", flex._BACKWARD_DEVICES | {"cpu"})
    validate = flex_module._validate_device

    def validate_without_cpu_backward_refusal(query, key, value):
        if query.device.type != "cpu":
            validate(query, key, value)

    monkeypatch.setattr(flex_module, "_validate_device", validate_without_cpu_backward_refusal)
