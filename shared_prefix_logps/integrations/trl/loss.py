"""TRL 1.15/1.16's GRPO loss of one micro-batch as ``grpo_loss`` computes it chunk by chunk: the counts that
reproduce TRL's per-micro-batch normalizers, the loss options built from the trainer, and the loss of any subset of
the micro-batch's rows."""

from __future__ import annotations

import torch

from ...losses import LOSS_TYPES, Count, GRPOLossOptions, grpo_loss_with_options

# Trainer attributes the loss reproduction reads (TRL 1.15 / 1.16 names).
REQUIRED_TRAINER_ATTRIBUTES = (
    "loss_type",
    "epsilon_low",
    "epsilon_high",
    "beta",
    "importance_sampling_level",
    "top_entropy_quantile",
    "off_policy_mask_threshold",
    "max_completion_length",
    "temperature",
    "get_high_entropy_mask",
    "_compute_loss",
)
REQUIRED_ARGS = (
    "delta",
    "use_bias_correction_kl",
    "steps_per_generation",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
)


def micro_batch_counts(
    completion_mask: torch.Tensor,
    *,
    loss_type: str,
    num_items_in_batch: Count,
    current_gradient_accumulation_steps: int = 1,
    steps_per_generation: int = 1,
    num_processes: int = 1,
    entropy_mask: torch.Tensor | None = None,
    training: bool = True,
) -> dict:
    """Counts that make ``grpo_loss`` reproduce TRL 1.16's loss for one of its micro-batches, chunk by chunk.

    TRL normalizes per micro-batch (the table in ``shared_prefix_logps.losses.aggregation``). To split one TRL
    micro-batch into row chunks (a chunked backward) and still get exactly TRL's micro-batch loss as the sum of the
    chunk losses, pass the returned dict to ``grpo_loss`` for every chunk (together with the chunk's own tensors). The
    per-rank loss already carries TRL's ``num_processes`` factor, so the returned ``num_processes`` is 1.

    Args:
        completion_mask: ``(B, C)`` loss mask of the whole TRL micro-batch (``completion_mask * tool_mask``).
        loss_type: TRL ``loss_type``.
        num_items_in_batch: TRL's ``inputs["num_items_in_batch"]`` (valid tokens of the generation batch, all ranks).
        current_gradient_accumulation_steps, steps_per_generation, num_processes: the trainer's values.
        entropy_mask: the micro-batch's high-entropy mask when ``top_entropy_quantile < 1`` (for the entropy bonus).
        training: False for evaluation (TRL divides by neither GA nor ``steps_per_generation`` then).

    Returns:
        dict with ``num_items_in_batch``, ``num_sequences_in_batch``, ``num_entropy_items_in_batch`` and
        ``num_processes`` (keyword arguments of ``grpo_loss``).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    ga = current_gradient_accumulation_steps if training else 1
    valid = completion_mask != 0
    local_tokens = valid.sum()
    if loss_type == "bnpo":
        n_tok = local_tokens * ga
    else:  # dapo/cispo/vespo; unused by the others
        n_tok = torch.as_tensor(num_items_in_batch).double().clamp(min=1.0) / num_processes
        if training:
            n_tok = n_tok * current_gradient_accumulation_steps / steps_per_generation
    eff = valid if entropy_mask is None else valid & entropy_mask.bool()
    return {
        "num_items_in_batch": n_tok,
        "num_sequences_in_batch": completion_mask.size(0) * ga,
        # TRL's bonus: mean entropy of the micro-batch's (effective) tokens / GA, whatever the loss type
        "num_entropy_items_in_batch": eff.sum().clamp(min=1) * ga,
        "num_processes": 1,
    }


def entropy_coefficient(trainer) -> float:
    """The entropy-bonus coefficient TRL's ``_compute_loss`` applies to this micro-batch.

    Read before TRL's own ``_compute_loss`` runs for the metrics: the adaptive controller may update it there, and
    the update is meant for the next optimizer step.
    """
    if not getattr(trainer, "_entropy_bonus_enabled", False):
        return 0.0
    if getattr(trainer, "use_adaptive_entropy", False):
        return trainer.entropy_coef if trainer._last_world_entropy <= trainer.args.entropy_target else 0.0
    return float(trainer.entropy_coef)


def loss_options(trainer) -> GRPOLossOptions:
    """The loss options of the trainer's next micro-batch, from its attributes and config (same names as TRL's).

    Built once per micro-batch, not once per run: the adaptive entropy controller changes ``entropy_coef`` between
    optimizer steps (:func:`entropy_coefficient`). ``num_processes`` is 1: TRL's per-rank loss carries the
    ``num_processes`` factor in its token count already (:func:`micro_batch_counts`).
    """
    args = trainer.args
    return GRPOLossOptions(
        loss_type=trainer.loss_type,
        epsilon_low=trainer.epsilon_low,
        epsilon_high=trainer.epsilon_high,
        delta=args.delta,
        beta=trainer.beta,
        use_bias_correction_kl=args.use_bias_correction_kl,
        importance_sampling_level=trainer.importance_sampling_level,
        off_policy_mask_threshold=trainer.off_policy_mask_threshold,
        sapo_temperature_pos=args.sapo_temperature_pos,
        sapo_temperature_neg=args.sapo_temperature_neg,
        vespo_k_pos=args.vespo_k_pos,
        vespo_lambda_pos=args.vespo_lambda_pos,
        vespo_k_neg=args.vespo_k_neg,
        vespo_lambda_neg=args.vespo_lambda_neg,
        max_completion_length=trainer.max_completion_length,
        entropy_coef=entropy_coefficient(trainer),
        num_processes=1,
    )


class MicroBatchLoss:
    """TRL's micro-batch loss as a function of any subset of its rows; summed over a partition of the rows it is
    TRL's loss of the whole micro-batch (:func:`micro_batch_counts`)."""

    def __init__(self, trainer, inputs, loss_mask, entropy_mask):
        self.options = loss_options(trainer)
        self.loss_mask = loss_mask
        self.entropy_mask = entropy_mask
        self.counts = micro_batch_counts(
            loss_mask,
            loss_type=trainer.loss_type,
            num_items_in_batch=inputs["num_items_in_batch"],
            current_gradient_accumulation_steps=trainer.current_gradient_accumulation_steps,
            steps_per_generation=trainer.args.steps_per_generation,
            num_processes=trainer.accelerator.num_processes,
            entropy_mask=entropy_mask,
            training=True,
        )
        self.advantages = inputs["advantages"]
        self.old = inputs.get("old_per_token_logps")
        self.ref = inputs.get("ref_per_token_logps") if trainer.beta != 0.0 else None
        self.sampling = inputs.get("sampling_per_token_logps")
        if trainer.loss_type == "vespo":
            self.is_ratio = inputs.get("importance_sampling_ratio")
        elif getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False):
            self.is_ratio = inputs["importance_sampling_ratio"]
        else:
            self.is_ratio = None

    def __call__(self, logps: torch.Tensor, entropies: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Loss of micro-batch ``rows`` (k,) given their (k, C) log-probs and entropies (differentiable)."""

        def take(tensor):
            return None if tensor is None else tensor[rows]

        out = grpo_loss_with_options(
            logps,
            take(self.old),
            self.advantages[rows],
            self.loss_mask[rows],
            self.options,
            ref_per_token_logps=take(self.ref),
            importance_sampling_ratio=take(self.is_ratio),
            sampling_per_token_logps=take(self.sampling),
            entropy_mask=take(self.entropy_mask),
            entropies=entropies,
            num_items_in_batch=self.counts["num_items_in_batch"],
            num_sequences_in_batch=self.counts["num_sequences_in_batch"],
            num_entropy_items_in_batch=self.counts["num_entropy_items_in_batch"],
        )
        return out.loss
