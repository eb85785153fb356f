"""``logsoftmax_gather``: differentiable per-token log-probs (and entropy) from a logits tensor."""

from __future__ import annotations

import math

import torch

from .implementation import implementation_argument, resolve_implementation, stats_backward, stats_forward


class LogsoftmaxGatherFunction(torch.autograd.Function):
    """Autograd node over 2-D logits; saves the logits plus per-row float32 statistics."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, return_entropy, ignore_index, inplace_backward, implementation):
        inv_t = 1.0 / temperature
        logps, norm, entropy = stats_forward(logits, targets, inv_t, ignore_index, return_entropy, implementation)
        ctx.save_for_backward(logits, targets, norm, entropy)
        ctx.inv_t = inv_t
        ctx.ignore_index = ignore_index
        ctx.inplace_backward = inplace_backward
        ctx.implementation = implementation
        ctx.return_entropy = return_entropy
        if return_entropy:
            return logps, entropy
        return logps

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        logits, targets, norm, entropy = ctx.saved_tensors
        grad_logps = grads[0]
        grad_entropy = grads[1] if ctx.return_entropy else None
        if grad_logps is None and grad_entropy is None:
            return (None,) * 7
        d_logits = stats_backward(
            logits,
            targets,
            norm,
            entropy,
            grad_logps,
            grad_entropy,
            ctx.inv_t,
            ctx.ignore_index,
            ctx.inplace_backward,
            ctx.implementation,
        )
        return d_logits, None, None, None, None, None, None


def logsoftmax_gather(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int = -100,
    inplace_backward: bool = False,
    implementation: str = "auto",
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target under ``softmax(logits / temperature)``, without materialising the log-softmax.

    Args:
        logits: (..., V) float16 / bfloat16 / float32; any row stride (the vocabulary dimension is best unit-strided,
            otherwise it is copied).
        targets: (...) int64 token ids in [0, V); ``ignore_index`` rows give log-prob 0, entropy 0, no gradient.
            An id out of range gives nan on the Triton path and an indexing error on the torch path.
        temperature: divides the logits before the softmax.
        return_entropy: also return the entropy ``-sum p log p`` of the tempered distribution.
        inplace_backward: let backward write d logits over the logits buffer (saves a (N, V) allocation); only
            safe when nothing else needs those logits after this call, and backward runs once (no retain_graph).
        implementation: ``"auto"`` (Triton on CUDA where its kernels can launch, see ``launch_probe``, or on CPU
            under ``TRITON_INTERPRET=1``; torch otherwise), ``"triton"`` or ``"torch"``.
        backend: deprecated name of ``implementation``.
    Returns:
        float32 log-probs shaped like ``targets``, never > 0; or ``(logps, entropy)`` when ``return_entropy``.
        Differentiable w.r.t. ``logits`` (the gradient has ``logits.dtype``).
    """
    if temperature <= 0 or not math.isfinite(temperature):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    implementation = implementation_argument(implementation, backend, "logsoftmax_gather")
    resolve_implementation(implementation, logits, targets)  # fail early on an impossible forced implementation
    out_shape = targets.shape
    logits_2d = logits.reshape(-1, logits.shape[-1])
    result = LogsoftmaxGatherFunction.apply(
        logits_2d,
        targets.reshape(-1).long(),
        float(temperature),
        return_entropy,
        int(ignore_index),
        inplace_backward,
        implementation,
    )
    if return_entropy:
        return result[0].reshape(out_shape), result[1].reshape(out_shape)
    return result.reshape(out_shape)
