"""Choose between the Triton kernels and the torch fallback for the log-softmax-gather statistics."""

from __future__ import annotations

import torch

from .._triton_utils import triton_can_run
from ._torch_reference import logsoftmax_gather_backward_torch, logsoftmax_gather_forward_torch

try:
    from . import logsoftmax_gather as _triton_impl
except Exception:  # no Triton, or a broken install: the torch fallback covers everything
    _triton_impl = None

BACKENDS = ("auto", "triton", "torch")


def resolve_backend(backend: str, *tensors: torch.Tensor) -> str:
    """Map ``"auto" | "triton" | "torch"`` to the backend that will run; ``"triton"`` raises if it cannot."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    can_triton = _triton_impl is not None and triton_can_run(*tensors)
    if backend == "auto":
        return "triton" if can_triton else "torch"
    if backend == "triton" and not can_triton:
        raise RuntimeError(
            "backend='triton' needs an importable Triton and CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)"
        )
    return backend


def stats_forward(logits, targets, inv_temperature, ignore_index, return_entropy, backend="auto"):
    """(logps, norm (2, N), entropy|None) of ``log_softmax(logits * inv_temperature)``; see ``_torch_reference``."""
    if resolve_backend(backend, logits, targets) == "triton":
        return _triton_impl.logsoftmax_gather_forward_triton(
            logits, targets, inv_temperature, ignore_index, return_entropy
        )
    return logsoftmax_gather_forward_torch(logits, targets, inv_temperature, ignore_index, return_entropy)


def stats_backward(
    logits, targets, norm, entropy, grad_logps, grad_entropy, inv_temperature, ignore_index, inplace, backend="auto"
):
    """d logits in ``logits.dtype`` (over ``logits`` when ``inplace``); see ``_torch_reference``."""
    if resolve_backend(backend, logits, targets) == "triton":
        impl = _triton_impl.logsoftmax_gather_backward_triton
    else:
        impl = logsoftmax_gather_backward_torch
    return impl(logits, targets, norm, entropy, grad_logps, grad_entropy, inv_temperature, ignore_index, inplace)
