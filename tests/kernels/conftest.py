"""Fixtures of the kernel tests."""

import pytest


@pytest.fixture(autouse=True, scope="module")
def interpret_triton_on_cpu():
    """Run the Triton kernels on CPU through Triton's interpreter, for the kernel tests only.

    The kernels read TRITON_INTERPRET at every launch (not at import), so setting it here is enough; doing it at
    import time instead would leak into every other test of the session and silently reroute their heads
    through the (slow) interpreter.
    """
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        yield
