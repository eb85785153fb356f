"""Pure-torch log-softmax-gather statistics: the fallback wherever the Triton kernels cannot run.

Both functions mirror the Triton kernels' contract exactly (same inputs, same outputs, same masking and clamping)
so callers can switch backends without caring which one ran. They upcast the whole (N, V) block to float32, so
callers that care about memory (the chunked head) hand them one chunk at a time.
"""

from __future__ import annotations

import torch


def logsoftmax_gather_forward_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    inv_temperature: float,
    ignore_index: int,
    return_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row statistics of ``log_softmax(logits * inv_temperature)``.

    Args:
        logits: (N, V) float16, bfloat16 or float32, any strides.
        targets: (N,) int64; rows equal to ``ignore_index`` get log-prob 0 and entropy 0.
    Returns:
        logps (N,) float32 clamped to <= 0, lse (N,) float32 log-sum-exp of the tempered logits,
        entropy (N,) float32 or None.
    """
    z = logits.float() * inv_temperature
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    lse = torch.logsumexp(z, dim=-1)
    target_z = z.gather(1, safe_targets[:, None]).squeeze(1)
    # Rounding can push target_z - lse a hair above 0 when one token holds all the mass; a positive log-prob is
    # never meaningful and has wrecked RL runs elsewhere (verl#2656), so clamp.
    logps = torch.where(valid, (target_z - lse).clamp_max(0.0), torch.zeros_like(lse))
    entropy = None
    if return_entropy:
        logp = z.sub_(lse[:, None])
        p = logp.exp()
        # p == 0 with logp == -inf would give nan; such entries contribute nothing to the entropy.
        plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
        entropy = torch.where(valid, -plogp.sum(-1), torch.zeros_like(lse))
    return logps, lse, entropy


def logsoftmax_gather_backward_torch(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logps: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    inv_temperature: float,
    ignore_index: int,
    inplace: bool = False,
) -> torch.Tensor:
    """Gradient of the forward's outputs w.r.t. ``logits``.

    ``d logits_j = inv_T * (g * (onehot_j - p_j) - g_H * p_j * (log p_j + H))`` with ``p`` the tempered softmax.

    Args:
        logits: (N, V) the forward's input; lse and entropy (N,) float32 from the forward.
        grad_logps, grad_entropy: (N,) or None (treated as zero).
        inplace: write the result into ``logits`` (the caller promises it no longer needs them).
    Returns:
        (N, V) in ``logits.dtype``; zero rows where ``targets == ignore_index``.
    """
    valid = targets != ignore_index
    zeros = torch.zeros_like(lse)
    z = logits.float() * inv_temperature
    logp = z.sub_(lse[:, None])
    p = logp.exp()
    grad = torch.zeros_like(p)
    if grad_logps is not None:
        g = torch.where(valid, grad_logps.float(), zeros)
        grad.addcmul_(p, g[:, None], value=-1.0)
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        grad.scatter_add_(1, safe_targets[:, None], g[:, None])
    if grad_entropy is not None:
        assert entropy is not None, "entropy gradient needs the forward's entropy"
        gh = torch.where(valid, grad_entropy.float(), zeros)
        term = torch.where(p > 0, p * (logp + entropy[:, None]), torch.zeros_like(p))
        grad.addcmul_(term, gh[:, None], value=-1.0)
    grad.mul_(inv_temperature)
    if inplace:
        return logits.copy_(grad)
    return grad.to(logits.dtype)
