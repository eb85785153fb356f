"""Shared setup of the kernel tests: both implementations of the statistics (the Triton one runs through its CPU
interpreter: see ``tests/kernels/conftest.py``)."""

import pytest

from shared_prefix_logps.kernels import implementation as kernel_implementation

TRITON_OK = kernel_implementation._triton_impl is not None
IMPLEMENTATIONS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="Triton not importable")),
]
