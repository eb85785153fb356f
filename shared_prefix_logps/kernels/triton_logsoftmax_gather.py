"""Triton kernels for the tempered log-softmax-gather: per-row statistics (forward) and d logits (backward).

Forward reads each row once: an online max/sum over vocabulary blocks (float32 accumulators) gives the
log-sum-exp, the entropy and the target's log-prob together. Backward reads the row once more and writes
``d logits``, optionally over the logits themselves. One program per row; only the unit stride of the vocabulary
dimension is required (rows may be strided, e.g. a slice of a larger logits buffer).

This module needs Triton; ``implementation.py`` decides whether it is used.
"""

from __future__ import annotations

import torch
import triton.language as tl

from ._triton_utils import LazyKernel, device_guard, interpret_enabled, next_power_of_2

# Reductions go through tl.reduce with Triton's own combine functions instead of tl.max / tl.sum: those two are
# jit functions decorated when triton.language is imported, so they only work in the mode (compiled or
# interpreted) Triton was imported in. The interpreter recognises these combine functions and reduces with numpy,
# which keeps the kernels runnable under TRITON_INTERPRET=1 set at call time, whatever the import order.
_MAX = tl.standard._elementwise_max
_SUM = tl.standard._sum_combine


def _logsoftmax_gather_fwd_kernel(
    logits_ptr,
    logits_row_stride,
    targets_ptr,
    logps_ptr,
    norm_ptr,
    norm_stride,
    entropy_ptr,
    n_cols,
    inv_temperature,
    ignore_index,
    BLOCK_V: tl.constexpr,
    RETURN_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    # Ignored rows skip the vocabulary loop entirely: they cost one target load.
    loop_end = tl.where(valid, n_cols, 0)

    # Running raw max m and, in the frame c = m (0 while m is -inf) with d = (x - c) / T:
    # s = sum exp(d) and w = sum exp(d) * d. Shifting before scaling keeps |x| ~ 1e4 exact (see
    # torch_logsoftmax_gather), and a shifted w avoids the cancellation of lse - E[z] in the entropy.
    m = float("-inf")
    s = 0.0
    w = 0.0
    for start in range(0, loop_end, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.reduce(x, 0, _MAX))
        frame = tl.where(m_new == float("-inf"), 0.0, m_new)
        shift = (m - frame) * inv_temperature  # -inf until the first finite logit: alpha = 0, old s = w = 0
        alpha = tl.exp(shift)
        d = (x - frame) * inv_temperature
        e = tl.exp(d)
        if RETURN_ENTROPY:
            # Re-express the old w in the new frame: sum e'd' = alpha * (w + shift * s).
            w = alpha * (w + tl.where(s > 0, shift, 0.0) * s)
            w += tl.reduce(e * tl.where(e > 0, d, 0.0), 0, _SUM)
        s = s * alpha + tl.reduce(e, 0, _SUM)
        m = m_new

    frame = tl.where(m == float("-inf"), 0.0, m)
    # s == 0 only for ignored rows; 1 keeps their (discarded) statistics finite.
    s = tl.where(s > 0, s, 1.0)
    log_s = tl.log(s)

    in_range = (target >= 0) & (target < n_cols)
    safe_target = tl.where(valid & in_range, target, 0)
    x_target = tl.load(row_ptr + safe_target).to(tl.float32)
    # Cannot be positive as computed (x_target <= frame and s >= 1: the max contributes exp(0) = 1 exactly), but the
    # guarantee matters too much to rest on an argument about rounding (verl#2656), so clamp anyway.
    logp = tl.minimum((x_target - frame) * inv_temperature - log_s, 0.0)
    # An out-of-range id is a caller bug: make it loud (nan) instead of reading another row's memory.
    logp = tl.where(in_range, logp, float("nan"))
    tl.store(logps_ptr + row, tl.where(valid, logp, 0.0))
    tl.store(norm_ptr + row, tl.where(valid, frame, 0.0))
    tl.store(norm_ptr + norm_stride + row, tl.where(valid, log_s, 0.0))
    if RETURN_ENTROPY:
        entropy = log_s - w / s
        tl.store(entropy_ptr + row, tl.where(valid, entropy, 0.0))


def _logsoftmax_gather_bwd_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_row_stride,
    targets_ptr,
    norm_ptr,
    norm_stride,
    entropy_ptr,
    grad_logps_ptr,
    grad_entropy_ptr,
    n_cols,
    inv_temperature,
    ignore_index,
    BLOCK_V: tl.constexpr,
    HAS_GRAD_LOGPS: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    grad_row_ptr = grad_ptr + row * grad_row_stride
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    row_max = tl.load(norm_ptr + row)
    log_s = tl.load(norm_ptr + norm_stride + row)
    g = 0.0
    if HAS_GRAD_LOGPS:
        g = tl.load(grad_logps_ptr + row).to(tl.float32)
    gh = 0.0
    h = 0.0
    if HAS_GRAD_ENTROPY:
        gh = tl.load(grad_entropy_ptr + row).to(tl.float32)
        h = tl.load(entropy_ptr + row)

    # Ignored rows read nothing (load limit 0; -inf gives p = 0) and write zeros.
    load_limit = tl.where(valid, n_cols, 0)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < load_limit, other=float("-inf")).to(tl.float32)
        logp = (x - row_max) * inv_temperature - log_s
        p = tl.exp(logp)
        d = tl.where(cols == target, g, 0.0) - g * p
        if HAS_GRAD_ENTROPY:
            # d H / d z_j = -p_j (log p_j + H); p_j == 0 (x_j = -inf) contributes nothing, not nan.
            d -= gh * p * tl.where(p > 0, logp + h, 0.0)
        d = d * inv_temperature
        tl.store(grad_row_ptr + cols, d.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)


_fwd_kernel = LazyKernel(_logsoftmax_gather_fwd_kernel)
_bwd_kernel = LazyKernel(_logsoftmax_gather_bwd_kernel)


# Tests set this to force several vocabulary blocks per row (the online rescaling) under the interpreter.
BLOCK_V_OVERRIDE: int | None = None


def _launch_config(n_cols: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps). The interpreter's cost is per block iteration, so it gets one big block."""
    if BLOCK_V_OVERRIDE is not None:
        return BLOCK_V_OVERRIDE, 4
    if interpret_enabled():
        return min(next_power_of_2(n_cols), 1 << 17), 4
    block = min(next_power_of_2(n_cols), 8192)
    return block, (16 if block >= 8192 else 8 if block >= 2048 else 4)


def _rows_unit_stride(logits: torch.Tensor) -> torch.Tensor:
    return logits if logits.stride(-1) == 1 else logits.contiguous()


def logsoftmax_gather_forward_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: float,
    ignore_index: int,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Triton twin of ``logsoftmax_gather_forward_torch``: logits (N, V), targets (N,) int64 ->
    logps (N,) float32 (<= 0), norm (2, N) float32, entropy (N,) float32 or None."""
    logits = _rows_unit_stride(logits)
    n_rows, n_cols = logits.shape
    targets = targets.contiguous()
    logps = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    norm = torch.empty((2, n_rows), dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(logps) if return_entropy else None
    if n_rows == 0:
        return logps, norm, entropy
    block, warps = _launch_config(n_cols)
    # Launch on the tensors' GPU, not the current one (models spread over GPUs).
    with device_guard(logits):
        _fwd_kernel[(n_rows,)](
            logits,
            logits.stride(0),
            targets,
            logps,
            norm,
            norm.stride(0),
            entropy if entropy is not None else logps,  # never written when RETURN_ENTROPY is False
            n_cols,
            float(inv_temperature),
            int(ignore_index),
            BLOCK_V=block,
            RETURN_ENTROPY=return_entropy,
            num_warps=warps,
        )
    return logps, norm, entropy


def logsoftmax_gather_backward_triton(
    logits: torch.Tensor,
    targets: torch.Tensor,
    norm: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logps: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    inv_temperature: float,
    ignore_index: int,
    inplace: bool = False,
) -> torch.Tensor:
    """Triton twin of ``logsoftmax_gather_backward_torch``: returns d logits (N, V) in ``logits.dtype``, written
    over ``logits`` when ``inplace`` (each row is read before it is overwritten by the same program)."""
    src = _rows_unit_stride(logits)
    n_rows, n_cols = src.shape
    out = src if inplace else torch.empty((n_rows, n_cols), dtype=src.dtype, device=src.device)
    if n_rows == 0:
        return out
    if grad_entropy is not None and entropy is None:
        raise ValueError("the entropy gradient needs the forward's entropy")
    if norm.stride(1) != 1:
        norm = norm.contiguous()
    block, warps = _launch_config(n_cols)
    # Launch on the tensors' GPU, not the current one (models spread over GPUs).
    with device_guard(src):
        _bwd_kernel[(n_rows,)](
            src,
            src.stride(0),
            out,
            out.stride(0),
            targets.contiguous(),
            norm,
            norm.stride(0),
            entropy.contiguous() if entropy is not None else norm,
            grad_logps.contiguous() if grad_logps is not None else norm,
            grad_entropy.contiguous() if grad_entropy is not None else norm,
            n_cols,
            float(inv_temperature),
            int(ignore_index),
            BLOCK_V=block,
            HAS_GRAD_LOGPS=grad_logps is not None,
            HAS_GRAD_ENTROPY=grad_entropy is not None,
            num_warps=warps,
        )
    if inplace and out is not logits:
        # logits had a non-unit column stride, so we worked on a copy; honour "in place" for the caller.
        logits.copy_(out)
        return logits
    return out
