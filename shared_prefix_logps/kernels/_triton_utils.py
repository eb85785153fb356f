"""When Triton can run, and kernels that pick compiled or interpreted mode at call time.

``triton.jit`` decides between the compiler and the CPU interpreter when it decorates, i.e. at import. Setting
``TRITON_INTERPRET=1`` after this package was imported (as tests do) would then have no effect, so kernels are
written as plain functions and wrapped by ``LazyKernel``, which decorates them on first launch in each mode.
Triton's own jit'd library functions (``tl.max``, ``tl.sum``) are fixed at import the same way, so kernels meant to
run in both modes avoid them (see ``triton_logsoftmax_gather.py``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import torch

_TRUE = {"1", "true", "yes", "on"}


@functools.cache
def triton_importable() -> bool:
    """Whether ``triton`` and ``triton.language`` import (a broken install counts as not importable)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def interpret_enabled() -> bool:
    """``TRITON_INTERPRET`` as it is now (read at every call, not at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def triton_can_run(*tensors: torch.Tensor) -> bool:
    """True if a Triton kernel can process ``tensors``: CUDA tensors, or any tensors under the interpreter."""
    if not triton_importable():
        return False
    if interpret_enabled():
        return True
    return all(t.is_cuda for t in tensors)


def device_guard(tensor: torch.Tensor):
    """Context for a Triton launch on ``tensor``: its CUDA device made current, so a kernel on a tensor of a second
    GPU (``device_map="auto"``) runs there, not on the current device; a no-op for CPU tensors (interpreter)."""
    if tensor.is_cuda:
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``)."""
    return 1 << max(int(n) - 1, 0).bit_length()


class LazyKernel:
    """A Triton kernel decorated on first launch, once per mode (compiled / interpreted)."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._by_mode: dict[bool, object] = {}
        functools.update_wrapper(self, fn)

    def _kernel(self):
        mode = interpret_enabled()
        kernel = self._by_mode.get(mode)
        if kernel is None:
            import triton

            kernel = self._by_mode[mode] = triton.jit(self.fn)
        return kernel

    def __getitem__(self, grid):
        return self._kernel()[grid]
