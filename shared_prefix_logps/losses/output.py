"""What a loss call returns: the differentiable loss and its detached metrics, under TRL 1.16's metric names."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["LossOutput", "masked_mean"]


@dataclass
class LossOutput:
    """Result of ``grpo_loss``.

    ``loss`` carries the gradient; everything else is detached. Metrics are means over this call's (micro-batch's)
    valid tokens; ``num_tokens`` / ``num_sequences`` let callers combine them over micro-batches and processes.
    Sequence-level quantities (``importance_sampling_level="sequence"``, VESPO's weights) are means over rows.

    Attributes:
        loss: 0-dim, dtype of ``per_token_logps``: the term to call ``backward`` on.
        policy_loss: ``loss`` before the entropy bonus (TRL's ``policy_loss`` metric), detached.
        num_tokens: 0-dim int64, valid tokens in this call.
        num_sequences: rows in this call.
        kl: mean per-token KL(pi || pi_ref) (k3 estimator, after the optional importance-ratio correction),
            None when ``beta == 0``.
        entropy: mean entropy over valid tokens, None when ``entropies`` was not given.
        clip_ratio_low / clip_ratio_high / clip_ratio_region: fraction of tokens whose ratio left the trust region on
            the side that cuts the gradient (ratio < 1 - eps_low with A < 0, ratio > 1 + eps_high with A > 0, either).
            Clipped loss types only.
        cispo_clip_ratio: fraction with ratio > epsilon_high and A > 0 (``cispo`` only).
        phi_seq_mean: mean VESPO gamma weight (``vespo`` only).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    num_tokens: torch.Tensor
    num_sequences: int
    kl: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    clip_ratio_low: torch.Tensor | None = None
    clip_ratio_high: torch.Tensor | None = None
    clip_ratio_region: torch.Tensor | None = None
    cispo_clip_ratio: torch.Tensor | None = None
    phi_seq_mean: torch.Tensor | None = None

    def metrics(self) -> dict[str, float]:
        """The metrics under TRL 1.16's metric names (``kl``, ``clip_ratio/low_mean`` ...), as Python floats."""
        names = {
            "policy_loss": self.policy_loss,
            "kl": self.kl,
            "entropy": self.entropy,
            "clip_ratio/low_mean": self.clip_ratio_low,
            "clip_ratio/high_mean": self.clip_ratio_high,
            "clip_ratio/region_mean": self.clip_ratio_region,
            "cispo_clip_ratio": self.cispo_clip_ratio,
            "vespo/phi_seq_mean": self.phi_seq_mean,
        }
        return {k: float(v) for k, v in names.items() if v is not None}


def masked_mean(x: torch.Tensor, maskf: torch.Tensor) -> torch.Tensor:
    """Detached mean of a metric over valid tokens.

    Args:
        x: ``(B, C)`` per-token values, or ``(B, 1)`` per-sequence values (any dtype; bool flags count as 0/1).
        maskf: ``(B, C)`` float 0-1 mask, in the loss dtype.

    Returns:
        0-dim tensor in ``maskf``'s dtype: the mean over valid tokens of a ``(B, C)`` tensor, the mean over rows of a
        ``(B, 1)`` one (0 with no rows), 0 when there is no valid token.
    """
    x = x.detach().to(maskf.dtype)
    if x.size(-1) == 1:  # TRL's rule: a width-1 tensor is one value per sequence, averaged over rows
        return x.mean() if x.numel() else x.new_zeros(())
    # where, not multiply: a non-finite value at a padded position must not turn the mean into NaN
    return torch.where(maskf != 0, x, torch.zeros_like(x)).sum() / maskf.sum().clamp(min=1.0)
