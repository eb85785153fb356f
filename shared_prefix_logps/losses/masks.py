"""Which tokens and rows the policy term keeps: TRL's high-entropy token mask (``top_entropy_quantile``) and
DeepSeek-V3.2's off-policy sequence mask.

Both are 0/1 selections, computed without gradient; ``token_weights.weight_tokens`` applies them to the policy loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["high_entropy_mask", "off_policy_sequence_mask"]


def high_entropy_mask(
    entropies: torch.Tensor, completion_mask: torch.Tensor, top_entropy_quantile: float, *, process_group=None
) -> torch.Tensor:
    """Keep the top-``top_entropy_quantile`` fraction of valid tokens by entropy (TRL's ``top_entropy_quantile``).

    The threshold is the ``1 - top_entropy_quantile`` quantile (linear interpolation, ``torch.quantile``) of the
    entropies of all valid tokens, gathered over ``process_group`` when ``torch.distributed`` is initialized, as in
    TRL's ``GRPOTrainer.get_high_entropy_mask``. TRL evaluates it per micro-batch (across processes), so its mask
    depends on the micro-batch split; to stay split-invariant compute it once over the whole accumulation window
    (e.g. pass the concatenated entropies) and slice the result.

    Args:
        entropies: ``(B, C)`` float per-token entropies (any float dtype; read without gradient).
        completion_mask: ``(B, C)`` 0-1 loss mask.
        top_entropy_quantile: ``rho`` in [0, 1]; 1.0 keeps every valid token.

    Returns:
        ``(B, C)`` bool mask, False on padding. ``torch.quantile`` limits the gathered size to 2**24 tokens.
    """
    if not 0.0 <= top_entropy_quantile <= 1.0:
        raise ValueError(f"top_entropy_quantile must be in [0, 1], got {top_entropy_quantile}")
    valid = completion_mask != 0
    values = entropies.detach()[valid].float()
    if dist.is_available() and dist.is_initialized():
        # Processes hold different numbers of valid tokens: gather the sizes, pad to the longest, gather, trim.
        world = dist.get_world_size(process_group)
        sizes = [torch.zeros((), dtype=torch.int64, device=values.device) for _ in range(world)]
        dist.all_gather(
            sizes, torch.tensor(values.numel(), dtype=torch.int64, device=values.device), group=process_group
        )
        longest = max(int(s) for s in sizes)
        padded = values.new_zeros(longest)
        padded[: values.numel()] = values
        parts = [values.new_zeros(longest) for _ in range(world)]
        dist.all_gather(parts, padded, group=process_group)
        values = torch.cat([p[: int(s)] for p, s in zip(parts, sizes, strict=True)])
    if values.numel() == 0:
        return torch.zeros_like(valid)
    threshold = torch.quantile(values, 1.0 - top_entropy_quantile)
    # Compare in the entropies' own dtype (TRL compares float64 entropies against the float32 quantile promoted)
    return (entropies.detach() >= threshold.to(entropies.dtype)) & valid


def off_policy_sequence_mask(
    per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    advantages: torch.Tensor,
    maskf: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """DeepSeek-V3.2 off-policy sequence masking (TRL ``off_policy_mask_threshold``): drop the rows with a negative
    advantage whose sampler drifted too far from the current policy.

    A row is dropped when A < 0 and the mean over its valid tokens of ``sampling_logp - logp`` exceeds
    ``threshold``: learning to avoid a completion the current policy would hardly produce anyway is mostly noise.

    Args:
        per_token_logps: ``(B, C)`` current log-probs (read without gradient).
        sampling_per_token_logps: ``(B, C)`` log-probs of the policy that sampled, in the loss dtype; NaN at padding
            is tolerated.
        advantages: ``(B, 1)`` or ``(B, C)`` in the loss dtype.
        maskf: ``(B, C)`` float 0-1 loss mask.
        threshold: the drift above which a negative-advantage row is dropped.

    Returns:
        bool keep mask broadcastable against the per-token loss: ``(B, 1)``, or ``(B, C)`` with per-token advantages.
    """
    drift = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0) * maskf
    mean_drift = drift.sum(-1, keepdim=True) / maskf.sum(-1, keepdim=True).clamp(min=1.0)
    return (advantages >= 0) | (mean_drift <= threshold)
