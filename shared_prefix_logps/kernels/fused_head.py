"""Fused, token-chunked lm_head + log-softmax-gather: per-token log-probs without (tokens x vocab) logits.

``linear_logps`` is what the model's lm_head proxy calls. The logits of only one chunk of tokens exist at a time:
forward keeps per-token statistics (softmax normaliser, entropy), backward recomputes each chunk's logits from the saved
hidden states and weight, unless the caller lets forward keep every chunk's logits (``keep_logits_bytes``: when they
fit, backward then skips the recomputation, a third of the head's work). A caller that makes many backward passes can
also hand a float32 buffer the weight's gradient is added into (``weight_grad``), instead of a fresh (V, H) gradient
per backward for autograd to add to ``.grad``.

Dtypes: each chunk's logits come from ``hidden @ weight.T (+ bias)`` in the inputs' common dtype (the matmul
output dtype follows the inputs, so bf16 inputs give bf16 logits, rounded exactly as the model's own lm_head would
round them); under ``torch.autocast`` the matmul runs in the autocast dtype, as an ``nn.Linear`` lm_head would.
Softcap, temperature and every softmax statistic are then computed in float32. Gradients are accumulated across
chunks in float32 and cast back to the input dtypes at the end.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .implementation import implementation_argument, resolve_implementation, stats_backward, stats_forward

# Rows are compacted before the autograd node, so the statistics see no ignored rows; this id matches none, so a
# stray negative id still fails loudly (nan / index error) instead of being silently skipped.
_NO_IGNORE = -(2**63)

# Bytes a chunk's buffers may hold at once when chunk_size is None, on CPU (see chunk_logit_bytes for what a row of
# the chunk holds).
DEFAULT_CHUNK_BYTES = 256 * 2**20

# On a GPU the budget is this share of the memory a new allocation can take (the driver's free memory plus what
# torch's caching allocator holds reserved but unused), within these bounds. cudaMemGetInfo alone counts the
# allocator's reserve as used: after a first training step has grown the reserve, free memory is a fraction of what
# is available and the chunks would shrink to the floor for every later step. A small chunk makes each chunk's
# d_weight matmul (inner dimension = rows) memory-bound on the float32 (V, H) accumulator; thousands of rows keep it
# compute-bound.
GPU_CHUNK_SHARE_OF_AVAILABLE = 1 / 8
GPU_CHUNK_BYTES_BOUNDS = (512 * 2**20, 8 * 2**30)
# Rows per chunk are a multiple of this on GPUs (matmul tile size).
GPU_ROW_MULTIPLE = 128


def cuda_available_bytes(device: torch.device) -> int:
    """Bytes a new allocation on CUDA ``device`` can take: free device memory plus the caching allocator's
    reserved-but-unallocated bytes (the same after a step as before it, unlike free memory alone)."""
    free, _total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(cached, 0)


def chunk_logit_bytes(compute_dtype: torch.dtype, softcap: float | None) -> int:
    """Bytes the chunk loop holds per logit at its peak, in backward (forward holds no more).

    The Triton statistics work in the logits' buffer and the gradient overwrites it, so without a softcap a chunk
    holds its logits in the matmul's dtype: 2 bytes (bfloat16) or 4 (float32). With a softcap backward holds the
    float32 capped logits (overwritten by their gradient) and the float32 ``tanh`` its chain rule needs: 8 bytes, the
    matmul's own output freed before the second of them exists. (The torch statistics, the fallback, add float32
    temporaries of their own beside these.)
    """
    return 8 if softcap is not None else compute_dtype.itemsize


def default_chunk_size(
    num_rows: int,
    vocab_size: int,
    budget_bytes: int | None = None,
    *,
    device: torch.device | None = None,
    available_bytes: int | None = None,
    logit_bytes: int = 4,
) -> int:
    """Rows per chunk so that one chunk's buffers, ``logit_bytes`` per logit (:func:`chunk_logit_bytes`), fit in the
    budget (at least 1 row).

    Without ``budget_bytes``: ``DEFAULT_CHUNK_BYTES`` on CPU; on CUDA an eighth of the memory available to a new
    allocation (``available_bytes``, else :func:`cuda_available_bytes` of ``device``) bounded to [512 MiB, 8 GiB],
    and rows rounded down to a multiple of 128 when there are at least 128.
    """
    cuda = device is not None and torch.device(device).type == "cuda"
    if budget_bytes is None:
        budget_bytes = DEFAULT_CHUNK_BYTES
        if cuda:
            if available_bytes is None:
                available_bytes = cuda_available_bytes(device)
            low, high = GPU_CHUNK_BYTES_BOUNDS
            budget_bytes = int(min(max(available_bytes * GPU_CHUNK_SHARE_OF_AVAILABLE, low), high))
    rows = max(1, min(max(num_rows, 1), budget_bytes // (logit_bytes * max(vocab_size, 1))))
    if cuda and rows >= GPU_ROW_MULTIPLE and rows < num_rows:
        rows -= rows % GPU_ROW_MULTIPLE
    return rows


def keep_logits_bytes(device: torch.device, *, available_bytes: int | None = None) -> int:
    """How many bytes of logits a chunked backward's head may keep from forward for backward, per node call: four
    chunks' worth of :func:`default_chunk_size`'s CPU budget (1 GiB); on CUDA one chunk's (an eighth of the memory
    available to an allocation, within its bounds). Each node call back-propagates once its chunks are done, so only
    the live calls' logits are kept at once."""
    if torch.device(device).type != "cuda":
        return 4 * DEFAULT_CHUNK_BYTES
    if available_bytes is None:
        available_bytes = cuda_available_bytes(device)
    low, high = GPU_CHUNK_BYTES_BOUNDS
    return int(min(max(available_bytes * GPU_CHUNK_SHARE_OF_AVAILABLE, low), high))


def _chunk_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    keep_tanh: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logits (rows, V) of one chunk; with softcap and ``keep_tanh`` also tanh(x / softcap) for backward's chain rule.

    Without softcap the logits stay in the matmul dtype (the statistics upcast internally); with softcap they are
    float32 so tanh does not round a second time.
    """
    logits = torch.addmm(bias, hidden, weight.t()) if bias is not None else hidden @ weight.t()
    if softcap is None:
        return logits, None
    tanh = logits.float().div_(softcap).tanh_()
    del logits  # the matmul's output (when not float32 already): freed before the capped copy exists
    if not keep_tanh:
        return tanh.mul_(softcap), None
    return tanh * softcap, tanh


_AUTOCAST_DEVICES = ("cuda", "cpu", "xpu")


def _no_autocast(device: torch.device):
    if device.type in _AUTOCAST_DEVICES:
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


# Whether torch.addmm(..., out_dtype=float32) works for a given (device type, input dtype); probed once each.
_FP32_OUT_ADDMM_OK: dict[tuple[str, torch.dtype], bool] = {}


def _fp32_out_addmm_ok(device: torch.device, dtype: torch.dtype) -> bool:
    """Probe (once) that half-precision addmm can write a float32 accumulator directly (CUDA only in torch 2.13).

    The probe's operands are small integers (exact in half precision, and so is every product and sum), so the
    result is compared exactly, and no random numbers are drawn: the caller's RNG streams stay as they were.
    """
    key = (device.type, dtype)
    if key not in _FP32_OUT_ADDMM_OK:
        try:
            a = (torch.arange(8 * 16, device=device) % 7 - 3).reshape(8, 16).to(dtype)
            b = (torch.arange(16 * 8, device=device) % 5 - 2).reshape(16, 8).to(dtype)
            acc = (torch.arange(8 * 8, device=device) % 3).reshape(8, 8).float()
            expected = acc + a.float() @ b.float()
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _FP32_OUT_ADDMM_OK[key] = bool(torch.equal(acc, expected))
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT_ADDMM_OK[key] = False
    return _FP32_OUT_ADDMM_OK[key]


def _accumulate_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with a float32 ``acc``; ``a`` and ``b`` in the compute dtype."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif acc.is_cuda and _fp32_out_addmm_ok(acc.device, a.dtype):
        # Accumulates straight into float32: no (V, H) half-precision temporary per chunk.
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.add_(a @ b)


class LinearLogpsFunction(torch.autograd.Function):
    """Autograd node of the chunked head over already-compacted rows (every target is a real token id)."""

    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        bias,
        targets,
        temperature,
        softcap,
        return_entropy,
        chunk_size,
        implementation,
        keep_logits=False,
        weight_grad=None,
    ):
        n = hidden.shape[0]
        inv_t = 1.0 / temperature
        logps = torch.empty(n, dtype=torch.float32, device=hidden.device)
        norm = torch.empty((2, n), dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logps) if return_entropy else None
        kept = []
        for start in range(0, n, chunk_size):
            end = min(start + chunk_size, n)
            logits, tanh = _chunk_logits(hidden[start:end], weight, bias, softcap, keep_tanh=keep_logits)
            lp, nm, ent = stats_forward(logits, targets[start:end], inv_t, _NO_IGNORE, return_entropy, implementation)
            logps[start:end] = lp
            norm[:, start:end] = nm
            if return_entropy:
                entropy[start:end] = ent
            if keep_logits:
                kept.append((logits, tanh))
            del logits, tanh
        ctx.save_for_backward(hidden, weight, bias, targets, norm, entropy)
        ctx.kept = kept
        ctx.weight_grad = weight_grad
        ctx.inv_t = inv_t
        ctx.softcap = softcap
        ctx.return_entropy = return_entropy
        ctx.chunk_size = chunk_size
        ctx.implementation = implementation
        if return_entropy:
            return logps, entropy
        return logps

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        hidden = ctx.saved_tensors[0]
        with _no_autocast(hidden.device):
            return LinearLogpsFunction._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads):
        hidden, weight, bias, targets, norm, entropy = ctx.saved_tensors
        grad_logps = grads[0]
        grad_entropy = grads[1] if ctx.return_entropy else None
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        n = hidden.shape[0]
        kept, ctx.kept = ctx.kept, None
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_h else None
        # The caller's buffer (float32, the weight's shape) collects the weight's gradient across backward passes.
        into_buffer = ctx.weight_grad is not None
        if into_buffer:
            grad_weight = ctx.weight_grad
        else:
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        if grad_logps is None and grad_entropy is None:
            return (None,) * 11
        for index, start in enumerate(range(0, n, ctx.chunk_size)):
            end = min(start + ctx.chunk_size, n)
            h = hidden[start:end]
            if kept:
                logits, tanh = kept[index]
                kept[index] = None  # freed as the backward goes
            else:
                logits, tanh = _chunk_logits(h, weight, bias, ctx.softcap, keep_tanh=True)
            # The chunk's logits are recomputed scratch, so d logits may overwrite them (inplace=True).
            d_logits = stats_backward(
                logits,
                targets[start:end],
                norm[:, start:end],
                entropy[start:end] if entropy is not None else None,
                grad_logps[start:end] if grad_logps is not None else None,
                grad_entropy[start:end] if grad_entropy is not None else None,
                ctx.inv_t,
                _NO_IGNORE,
                True,
                ctx.implementation,
            )
            if tanh is not None:
                # d/dx [c * tanh(x / c)] = 1 - tanh^2, computed in tanh's buffer to avoid another chunk tensor.
                d_logits = tanh.mul_(tanh).neg_().add_(1.0).mul_(d_logits)
            del logits
            d_mm = d_logits.to(h.dtype)
            if need_h:
                torch.mm(d_mm, weight, out=grad_hidden[start:end])
            if grad_weight is not None:
                _accumulate_mm(grad_weight, d_mm.t(), h)
            if need_b:
                grad_bias.add_(d_logits.float().sum(0))
            del d_logits, d_mm, tanh  # before the next chunk's logits exist
        if into_buffer:
            grad_weight = None
        elif grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, *(None,) * 8


def linear_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    chunk_size: int | None = None,
    ignore_index: int | None = -100,
    implementation: str = "auto",
    backend: str | None = None,
    keep_logits_bytes: int = 0,
    weight_grad: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs (and entropy) of ``targets`` under ``hidden @ weight.T (+ bias)``, chunked over tokens.

    Args:
        hidden: (N, H) or (..., H) float16 / bfloat16 / float32 final hidden states.
        weight: (V, H) lm_head weight (possibly the tied embedding).
        targets: (N,) or (...) int64 token ids; ``ignore_index`` marks rows to skip: they get log-prob 0 and
            entropy 0, no gradient, and are compacted away before the matmul so they cost nothing.
        bias: (V,) or None.
        temperature: the tempered distribution is ``softmax(logits / temperature)``.
        softcap: if set, ``logits = softcap * tanh(logits / softcap)`` before the temperature (Gemma-2 style).
        return_entropy: also return ``-sum p log p`` of the tempered distribution.
        chunk_size: rows per chunk; None picks it so one chunk's buffers (:func:`chunk_logit_bytes` per logit:
            the logits in the matmul dtype, 8 bytes with a softcap) take about 256 MiB on CPU, an eighth of the
            memory available to an allocation on CUDA (see :func:`default_chunk_size`).
        ignore_index: target value of rows to skip; None: every row is scored (no search for skipped rows, which
            reads the device from the host).
        implementation: per-chunk statistics by ``"triton"`` kernels, ``"torch"``, or ``"auto"`` (Triton on CUDA
            where its kernels can launch, see ``launch_probe``, or on CPU under ``TRITON_INTERPRET=1``).
        backend: deprecated name of ``implementation``.
        keep_logits_bytes: with gradients, keep every chunk's logits from forward for backward when they take at most
            this many bytes (rows x V x :func:`chunk_logit_bytes`), so that backward does not recompute them; 0
            (default) keeps none.
        weight_grad: a float32 tensor of ``weight``'s shape, or None: backward adds the weight's gradient into it and
            returns none for ``weight`` (the caller hands the buffer to the parameter once, after its last backward).
            Only for a ``weight`` that is the parameter itself (or a cast of it).
    Returns:
        float32 log-probs shaped like ``targets`` (always <= 0), or ``(logps, entropy)`` when ``return_entropy``.
        Differentiable w.r.t. ``hidden``, ``weight`` and ``bias`` (through the entropy too).
    """
    if temperature <= 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    out_shape = targets.shape
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1)
    if hidden_2d.shape[0] != flat_targets.shape[0]:
        raise ValueError(f"hidden has {hidden_2d.shape[0]} rows but targets has {flat_targets.shape[0]}")
    if weight.dim() != 2 or weight.shape[1] != hidden_2d.shape[1]:
        raise ValueError(f"weight must be (V, {hidden_2d.shape[1]}), got {tuple(weight.shape)}")
    implementation = implementation_argument(implementation, backend, "linear_logps")
    resolve_implementation(implementation, hidden, weight)  # fail early on an impossible forced implementation

    n = flat_targets.shape[0]
    compact = False
    if ignore_index is not None:
        keep = (flat_targets != ignore_index).nonzero().squeeze(1)
        compact = keep.shape[0] != n
    if compact:
        hidden_2d = hidden_2d.index_select(0, keep)
        flat_targets = flat_targets.index_select(0, keep)

    device_type = hidden.device.type
    if device_type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
        # What the model's own lm_head (an nn.Linear) would compute under autocast.
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden_2d.dtype, weight.dtype)
        if bias is not None:
            compute_dtype = torch.promote_types(compute_dtype, bias.dtype)
    hidden_2d = hidden_2d.to(compute_dtype)
    weight = weight.to(compute_dtype)
    bias = bias.to(compute_dtype) if bias is not None else None
    rows = hidden_2d.shape[0]
    if chunk_size is None:
        logit_bytes = chunk_logit_bytes(compute_dtype, softcap)
        chunk_size = default_chunk_size(rows, weight.shape[0], device=hidden_2d.device, logit_bytes=logit_bytes)
    chunk_size = max(1, int(chunk_size))

    if rows == 0:
        # Nothing to compute; still return tensors connected to the inputs so backward() works.
        zero = sum(t.float().sum() for t in (hidden_2d, weight, bias) if t is not None) * 0.0
        logps = zero.expand(0)
        outs = (logps, logps.clone()) if return_entropy else (logps,)
    else:
        grad_needed = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (hidden_2d, weight, bias)
        )
        per_row = weight.shape[0] * chunk_logit_bytes(compute_dtype, softcap)  # what forward keeps per row
        keep_logits = grad_needed and rows * per_row <= keep_logits_bytes
        with _no_autocast(hidden.device):  # dtypes were fixed above; forward and backward must agree on them
            result = LinearLogpsFunction.apply(
                hidden_2d,
                weight,
                bias,
                flat_targets.long(),
                float(temperature),
                softcap,
                return_entropy,
                chunk_size,
                implementation,
                keep_logits,
                weight_grad,
            )
        outs = result if return_entropy else (result,)

    if compact:
        outs = tuple(o.new_zeros(n).index_copy(0, keep, o) for o in outs)
    outs = tuple(o.reshape(out_shape) for o in outs)
    return outs if return_entropy else outs[0]
