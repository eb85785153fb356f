"""The static settings of a GRPO-family loss as one frozen, validated object.

Trainers build a ``GRPOLossOptions`` from their own config (the TRL plug-in: ``integrations.trl.loss.loss_options``)
and pass it with each micro-batch's tensors to ``grpo_loss_with_options``. Settings are checked once, here, rather than
on every call; what can only be checked against the tensors (shapes, a reference policy when ``beta != 0``) is checked
by the loss itself.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

__all__ = ["IMPORTANCE_SAMPLING_LEVELS", "LOSS_TYPES", "GRPOLossOptions"]

# TRL 1.16's loss_type values, in TRL's order.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")

# Settings that must be real numbers (ints are fine: configs often hold 0 for 0.0), and those that may also be None.
_REAL = (
    "epsilon_low",
    "epsilon_high",
    "beta",
    "entropy_coef",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
)
_OPTIONAL_REAL = ("delta", "off_policy_mask_threshold")


@dataclass(frozen=True, kw_only=True)
class GRPOLossOptions:
    """Every static setting of ``grpo_loss`` (TRL ``GRPOConfig``/``GRPOTrainer`` names), validated on construction.

    Frozen: one object can be shared by all micro-batches and chunks of a step without any of them changing it; use
    ``dataclasses.replace`` for a variant. Invalid values raise ``ValueError`` (or ``TypeError`` for a wrong type)
    naming the argument.

    Attributes:
        loss_type: one of ``LOSS_TYPES`` (TRL ``loss_type``).
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]`` (TRL ``epsilon`` and
            ``epsilon_high``); for ``cispo`` ``epsilon_high`` is the cap on the ratio itself (epsilon_max, e.g. 5).
        delta: INTELLECT-2 two-sided clipping: the unclipped ratio is also capped at ``delta`` (TRL ``delta``).
        beta: KL coefficient; the loss then needs ``ref_per_token_logps``.
        use_bias_correction_kl: multiply the k3 KL estimate ``exp(ref - logp) - (ref - logp) - 1`` by the
            (differentiable) importance ratio, as TRL 1.16 does by default.
        max_completion_length: TRL's ``max_completion_length``; required by ``dr_grpo`` (its normalizer).
        num_processes: world size when the gradients are averaged over processes (DDP/FSDP/DeepSpeed), else 1.
            The loss is multiplied by it so that the averaged gradient is the global gradient.
        importance_sampling_level: ``"token"`` (one ratio per token) or ``"sequence"`` (GSPO: one ratio per row,
            ``exp`` of the mean token log-ratio).
        entropy_coef: entropy bonus coefficient (the loss then needs ``entropies``).
        off_policy_mask_threshold: DeepSeek-V3.2 off-policy sequence masking threshold; None switches it off.
        sapo_temperature_pos, sapo_temperature_neg: SAPO gate temperatures for A > 0 and A <= 0.
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: VESPO gamma-weight parameters (A >= 0 / A < 0).
    """

    loss_type: str = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    max_completion_length: int | None = None
    num_processes: int = 1
    importance_sampling_level: str = "token"
    entropy_coef: float = 0.0
    off_policy_mask_threshold: float | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self):
        # Types first, so that the value checks below can compare and format without surprises.
        for name in _REAL + _OPTIONAL_REAL:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL_REAL:
                continue
            # bool is an int subclass; True as an epsilon is a config mistake, not a number.
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                kind = "a real number or None" if name in _OPTIONAL_REAL else "a real number"
                raise TypeError(f"{name} must be {kind}, got {type(value).__name__} {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"{name} must be finite, got {value!r}")
        if not isinstance(self.use_bias_correction_kl, bool):
            raise TypeError(f"use_bias_correction_kl must be a bool, got {type(self.use_bias_correction_kl).__name__}")
        for name in ("max_completion_length", "num_processes"):
            value = getattr(self, name)
            if value is None and name == "max_completion_length":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r}; expected one of {LOSS_TYPES}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be 'token' or 'sequence', got {self.importance_sampling_level!r}"
            )
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        # SAPO divides by its temperatures (the gate's 4 / tau): zero or a negative one has no meaning.
        for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
