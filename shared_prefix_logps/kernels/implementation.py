"""Which implementation computes the log-softmax-gather statistics: the Triton kernels or the torch fallback.

(An *implementation* of a kernel; the attention *backend* of the shared path is a different choice, made in
``inputs.py``.)
"""

from __future__ import annotations

import warnings

import torch

from . import launch_probe
from ._triton_utils import interpret_enabled, triton_can_run
from .torch_logsoftmax_gather import logsoftmax_gather_backward_torch, logsoftmax_gather_forward_torch

try:
    from . import triton_logsoftmax_gather as _triton_impl
except Exception:  # no Triton, or a broken install: the torch fallback covers everything
    _triton_impl = None

IMPLEMENTATIONS = ("auto", "triton", "torch")


def resolve_implementation(implementation: str, *tensors: torch.Tensor) -> str:
    """Map ``"auto" | "triton" | "torch"`` to the implementation that will run; ``"triton"`` raises if it cannot.

    ``"auto"`` is Triton on CUDA tensors once :mod:`.launch_probe` found that compiled kernels launch in this process
    (else torch, with one warning), Triton on any tensors under ``TRITON_INTERPRET=1``, torch otherwise.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "torch":
        return "torch"
    reason = _why_not_triton(tensors)
    if reason is None:
        return "triton"
    if implementation == "triton":
        raise RuntimeError(f"implementation='triton' cannot run: {reason}; pass implementation='torch' or 'auto'")
    if isinstance(reason, launch_probe.LaunchStatus):
        launch_probe.warn_fallback_once(reason)
    return "torch"


def _why_not_triton(tensors) -> str | launch_probe.LaunchStatus | None:
    """None when the Triton kernels can process ``tensors``; else why not (the probe's status for CUDA tensors)."""
    if _triton_impl is None:
        return "Triton is not importable"
    if not triton_can_run(*tensors):
        return "it needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors)"
    if interpret_enabled():
        return None
    status = launch_probe.cuda_launch_status(tensors[0].device)
    return None if status.ok else status


def stats_forward(logits, targets, inv_temperature, ignore_index, return_entropy, implementation="auto"):
    """(logps, norm (2, N), entropy|None) of ``log_softmax(logits * inv_temperature)``; see
    ``torch_logsoftmax_gather``."""
    if resolve_implementation(implementation, logits, targets) == "triton":
        return _triton_impl.logsoftmax_gather_forward_triton(
            logits, targets, inv_temperature, ignore_index, return_entropy
        )
    return logsoftmax_gather_forward_torch(logits, targets, inv_temperature, ignore_index, return_entropy)


def stats_backward(
    logits,
    targets,
    norm,
    entropy,
    grad_logps,
    grad_entropy,
    inv_temperature,
    ignore_index,
    inplace,
    implementation="auto",
):
    """d logits in ``logits.dtype`` (over ``logits`` when ``inplace``); see ``torch_logsoftmax_gather``."""
    if resolve_implementation(implementation, logits, targets) == "triton":
        impl = _triton_impl.logsoftmax_gather_backward_triton
    else:
        impl = logsoftmax_gather_backward_torch
    return impl(logits, targets, norm, entropy, grad_logps, grad_entropy, inv_temperature, ignore_index, inplace)


def implementation_argument(implementation: str, backend: str | None, function: str) -> str:
    """The implementation a public kernel function was asked for, from ``implementation=`` or its earlier name
    ``backend=`` (still accepted, with a ``DeprecationWarning``: *backend* now names only the attention path)."""
    if backend is None:
        return implementation
    if implementation != "auto":
        raise TypeError(f"{function}() got both implementation= and its deprecated name backend=; pass implementation")
    warnings.warn(
        f"{function}(backend=...) is deprecated; pass implementation=... (the same values)",
        DeprecationWarning,
        stacklevel=3,
    )
    return backend
