"""The policy term of each loss type: the per-token loss before masks, corrections, KL and normalization.

``POLICY_TERMS`` maps every loss type to its term. Loss types that differ only in normalization share one term:
``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` and ``luspo`` are all the PPO clipped surrogate (``aggregation`` tells them
apart). Each term takes the same ``PolicyInputs`` and the options, and returns a ``PolicyTerm``: the per-token loss and
its metrics (detached means over valid tokens, under ``LossOutput``'s field names).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .options import GRPOLossOptions
from .output import masked_mean

__all__ = ["POLICY_TERMS", "PolicyInputs", "PolicyTerm", "cispo", "clipped_surrogate", "sapo", "vespo"]


@dataclass(frozen=True)
class PolicyInputs:
    """What every policy term may read; all in the loss dtype, ``B`` rows, ``C`` positions.

    Attributes:
        per_token_logps: ``(B, C)`` log pi_theta, differentiable.
        log_ratio: ``(B, C)`` log(pi / pi_old), 0 at padding (``token_weights.log_ratio``).
        ratio: ``(B, C)``, or ``(B, 1)`` at sequence level, importance ratio (``token_weights.importance_ratio``).
        advantages: ``(B, 1)`` or ``(B, C)``, no gradient.
        maskf: ``(B, C)`` float 0-1 loss mask.
        importance_sampling_ratio: the prepared vLLM correction (``token_weights.vllm_importance_ratio``) or None.
    """

    per_token_logps: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    advantages: torch.Tensor
    maskf: torch.Tensor
    importance_sampling_ratio: torch.Tensor | None


@dataclass(frozen=True)
class PolicyTerm:
    """A policy term's result.

    Attributes:
        per_token_loss: ``(B, C)``, or ``(B, 1)`` for a sequence-level ratio with nothing per-token in the term.
        metrics: ``LossOutput`` field name -> detached 0-dim metric.
        applies_importance_sampling_ratio: the term already used the vLLM correction (VESPO puts it into its gamma
            weight), so it must not multiply the per-token loss again.
    """

    per_token_loss: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    applies_importance_sampling_ratio: bool = False


def clipped_surrogate(x: PolicyInputs, options: GRPOLossOptions) -> PolicyTerm:
    """PPO's clipped surrogate ``-min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A)`` (grpo/bnpo/dr_grpo/dapo/luspo).

    With ``delta`` (INTELLECT-2) the unclipped ratio is also capped at ``delta``, so that a huge ratio with A < 0
    cannot blow the loss up; the clip-ratio metrics read the capped ratio, as TRL's do.
    """
    ratio, advantages, dtype = x.ratio, x.advantages, x.per_token_logps.dtype
    clipped = ratio.clamp(1.0 - options.epsilon_low, 1.0 + options.epsilon_high)
    if options.delta is not None:
        ratio = ratio.clamp(max=options.delta)
    per_token_loss = -torch.minimum(ratio * advantages, clipped * advantages)
    # Clipping only cuts the gradient on the side where min() picks the clipped value.
    low = (ratio < 1.0 - options.epsilon_low) & (advantages < 0)
    high = (ratio > 1.0 + options.epsilon_high) & (advantages > 0)
    metrics = {
        "clip_ratio_low": masked_mean(low.to(dtype), x.maskf),
        "clip_ratio_high": masked_mean(high.to(dtype), x.maskf),
        "clip_ratio_region": masked_mean((low | high).to(dtype), x.maskf),
    }
    return PolicyTerm(per_token_loss, metrics)


def cispo(x: PolicyInputs, options: GRPOLossOptions) -> PolicyTerm:
    """CISPO (MiniMax-M1): ``-sg(min(r, eps_high)) * A * logp``.

    Clip the (detached) importance weight, keep the REINFORCE gradient through logp for every token: unlike PPO's
    clip, no token loses its gradient. ``epsilon_high`` is the cap on the ratio itself (epsilon_max).
    """
    ratio, advantages = x.ratio, x.advantages
    per_token_loss = -ratio.clamp(max=options.epsilon_high).detach() * advantages * x.per_token_logps
    hit = (ratio > options.epsilon_high) & (advantages > 0)
    return PolicyTerm(per_token_loss, {"cispo_clip_ratio": masked_mean(hit.to(x.per_token_logps.dtype), x.maskf)})


def sapo(x: PolicyInputs, options: GRPOLossOptions) -> PolicyTerm:
    """SAPO: a soft gate ``sigmoid(tau * (r - 1)) * 4 / tau`` instead of a hard clip, ``-gate * A``.

    The gate's slope at r = 1 is 1 (the unclipped surrogate's) and decays smoothly away from it; negative advantages
    get the (by default higher) temperature ``sapo_temperature_neg``, which decays faster.
    """
    advantages = x.advantages
    tau = torch.where(advantages > 0, options.sapo_temperature_pos, options.sapo_temperature_neg)
    tau = tau.to(x.per_token_logps.dtype)
    gate = torch.sigmoid(tau * (x.ratio - 1.0)) * (4.0 / tau)
    return PolicyTerm(-gate * advantages)


def vespo_weights(x: PolicyInputs, options: GRPOLossOptions) -> torch.Tensor:
    """VESPO's per-sequence gamma weight phi(w) = exp(lambda) * w**k * exp(-lambda * w), w the sequence ratio.

    ``w`` = exp(sum_t log(pi/pi_old)) (a product over tokens, not a mean), times the vLLM importance ratio when
    given; logs clamped to [log 1e-8, 20] as TRL does. Computed without gradient: phi only rescales the
    REINFORCE-style term ``-phi * A * logp``. Returns ``(B, 1)`` (``(B, C)`` with per-token advantages), 0 where the
    weight is not finite.
    """
    maskf = x.maskf
    with torch.no_grad():
        floor = math.log(1e-8)
        seq_log_w = (x.log_ratio.clamp(-20.0, 20.0) * maskf).sum(-1, keepdim=True)
        if x.importance_sampling_ratio is not None:
            # Clamp the log, not the ratio: a ratio of exactly 0 (masked by vLLM IS) must give log = floor, not -inf.
            # TRL sums over all positions; its ratio is exactly 1 at padding (log 0). Summing over valid tokens only
            # gives the same number there and keeps the weight independent of how wide the micro-batch is padded.
            is_log = torch.log(x.importance_sampling_ratio.to(maskf.dtype)).clamp(floor, 20.0)
            if is_log.size(-1) == maskf.size(-1):
                is_log = is_log * maskf
            seq_log_w = seq_log_w + is_log.sum(-1, keepdim=True)
        log_w = seq_log_w.clamp(floor, 20.0)
        nonneg = x.advantages >= 0
        k = torch.where(nonneg, options.vespo_k_pos, options.vespo_k_neg)
        lam = torch.where(nonneg, options.vespo_lambda_pos, options.vespo_lambda_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo(x: PolicyInputs, options: GRPOLossOptions) -> PolicyTerm:
    """VESPO: ``-phi * A * logp`` with the detached gamma weight phi of :func:`vespo_weights`.

    The vLLM correction enters phi (a sequence-level weight), so it is reported as applied.
    """
    phi = vespo_weights(x, options)
    per_token_loss = -phi * x.advantages * x.per_token_logps
    return PolicyTerm(
        per_token_loss, {"phi_seq_mean": masked_mean(phi, x.maskf)}, applies_importance_sampling_ratio=True
    )


POLICY_TERMS: dict[str, Callable[[PolicyInputs, GRPOLossOptions], PolicyTerm]] = {
    "grpo": clipped_surrogate,
    "bnpo": clipped_surrogate,
    "dr_grpo": clipped_surrogate,
    "dapo": clipped_surrogate,
    "cispo": cispo,
    "sapo": sapo,
    "luspo": clipped_surrogate,
    "vespo": vespo,
}
