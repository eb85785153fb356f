"""Pure-torch log-softmax-gather statistics: the fallback wherever the Triton kernels cannot run.

Both functions mirror the Triton kernels' contract exactly (same inputs, same outputs, same masking and clamping)
so callers can switch implementations without caring which one ran. They upcast the whole (N, V) block to float32, so
callers that care about memory (the chunked head) hand them one chunk at a time.

Numerics shared with the kernels: the row maximum is subtracted from the *raw* logits before the temperature is
applied, ``d = (x - max x) / T``. Subtracting first is exact for nearby values, whereas ``x / T`` at |x| ~ 1e4
already rounds by ~1e-3 in float32; the per-row normaliser is therefore kept as two numbers (``norm``: the raw
row max and ``log sum exp d``) instead of one rounded log-sum-exp.
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
        targets: (N,) int64; rows equal to ``ignore_index`` get log-prob 0, entropy 0 and norm 0.
    Returns:
        logps (N,) float32 clamped to <= 0;
        norm (2, N) float32: ``norm[0]`` the row max of the raw logits, ``norm[1] = log sum exp((x - max) / T)``
        (so the tempered log-sum-exp is ``norm[0] / T + norm[1]``);
        entropy (N,) float32 or None.
    """
    valid = targets != ignore_index
    zeros = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    x = logits.to(torch.float32, copy=True)  # .float() would alias float32 input and the in-place ops below
    row_max = x.amax(dim=-1)
    frame = torch.where(row_max == float("-inf"), zeros, row_max)
    d = x.sub_(frame[:, None]).mul_(inv_temperature)
    log_norm = torch.logsumexp(d, dim=-1)
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    logp_target = d.gather(1, safe_targets[:, None]).squeeze(1) - log_norm
    # Non-positive as computed (gathered d <= 0 and logsumexp(d) >= 0), but a positive log-prob has wrecked RL runs
    # elsewhere (verl#2656), so the guarantee does not rest on an argument about rounding: clamp.
    logps = torch.where(valid, logp_target.clamp_max(0.0), zeros)
    norm = torch.stack([torch.where(valid, frame, zeros), torch.where(valid, log_norm, zeros)])
    entropy = None
    if return_entropy:
        logp = d.sub_(log_norm[:, None])
        p = logp.exp()
        # p == 0 with logp == -inf would give nan; such entries contribute nothing to the entropy.
        plogp = torch.where(p > 0, p * logp, torch.zeros_like(p))
        entropy = torch.where(valid, -plogp.sum(-1), zeros)
    return logps, norm, entropy


def logsoftmax_gather_backward_torch(
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
    """Gradient of the forward's outputs w.r.t. ``logits``.

    ``d logits_j = (g * (onehot_j - p_j) - g_H * p_j * (log p_j + H)) / T`` with ``p`` the tempered softmax.

    Args:
        logits: (N, V) the forward's input; norm (2, N) and entropy (N,) float32 from the forward.
        grad_logps, grad_entropy: (N,) or None (treated as zero).
        inplace: write the result into ``logits`` (the caller promises it no longer needs them).
    Returns:
        (N, V) in ``logits.dtype``; zero rows where ``targets == ignore_index``.
    """
    valid = targets != ignore_index
    zeros = torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    logp = logits.to(torch.float32, copy=True).sub_(norm[0][:, None]).mul_(inv_temperature).sub_(norm[1][:, None])
    # Ignored rows: their norm is a placeholder, so exp could overflow there; p = 0 makes their gradient exactly 0.
    logp.masked_fill_(~valid[:, None], float("-inf"))
    p = logp.exp()
    grad = torch.zeros_like(p)
    if grad_logps is not None:
        g = torch.where(valid, grad_logps.float(), zeros)
        grad.addcmul_(p, g[:, None], value=-1.0)
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        grad.scatter_add_(1, safe_targets[:, None], g[:, None])
    if grad_entropy is not None:
        if entropy is None:
            raise ValueError("the entropy gradient needs the forward's entropy")
        gh = torch.where(valid, grad_entropy.float(), zeros)
        term = torch.where(p > 0, p * (logp + entropy[:, None]), torch.zeros_like(p))
        grad.addcmul_(term, gh[:, None], value=-1.0)
    grad.mul_(inv_temperature)
    if inplace:
        return logits.copy_(grad)
    return grad.to(logits.dtype)
