"""Shared setup of the kernel tests: both statistics backends, Triton run through its CPU interpreter."""

import pytest

from shared_prefix_logps.kernels import implementation as kernel_implementation

TRITON_OK = kernel_implementation._triton_impl is not None
IMPLEMENTATIONS = [
    "torch",
    pytest.param("triton", marks=pytest.mark.skipif(not TRITON_OK, reason="Triton not importable")),
]


@pytest.fixture(autouse=True, scope="module")
def interpret_triton_on_cpu():
    """Run the Triton kernels on CPU through Triton's interpreter, for the importing module only.

    The kernels read TRITON_INTERPRET at every launch (not at import), so setting it here is enough; doing it at
    import time instead would leak into every other test module of the session and silently reroute their heads
    through the (slow) interpreter.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield
