"""GRPO-family policy losses on per-token log-probs, normalized by *global* counts.

Every loss type of TRL 1.16's ``GRPOTrainer._compute_loss`` (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``, ``cispo``,
``sapo``, ``luspo``, ``vespo``) is computed here from tensors alone, with the same argument names as TRL's quantities.

Why a separate implementation: TRL normalizes several loss types per micro-batch (a per-sequence mean then a batch
mean, or a token mean over the micro-batch), then divides by the number of accumulation steps. That makes the
gradient depend on how the batch was cut into micro-batches (verl#906, transformers#34191, trl#3231). Here every
normalizer is a count taken over the *whole* optimizer step (all micro-batches, all accumulation steps, all
processes) and passed in, so that

    sum over micro-batches of grpo_loss(micro-batch, global counts)  ==  grpo_loss(full batch)

for the loss value and its gradient, whatever the split (rows of a batch never interact in these losses: importance
ratios, clipping, KL, sequence means and VESPO's weights are all per row). The normalizer of each loss type, next to
TRL's, is tabulated in ``aggregation``.

Distributed data parallel (DDP, FSDP, DeepSpeed) *averages* gradients over processes. Pass ``num_processes`` = the
world size and the loss is multiplied by it, so that the averaged gradient is the gradient of the global loss (TRL
does the same by dividing ``num_items_in_batch`` by ``accelerator.num_processes``).

Modules, one step each: ``options`` (the frozen settings, ``GRPOLossOptions``), ``counts`` (global counts and the
denominators made from them), ``masks`` (high-entropy token mask, off-policy sequence mask), ``token_weights``
(importance ratio, vLLM correction, KL penalty, applying them), ``policy_terms`` (one term per loss type family in a
dispatch table), ``aggregation`` (the normalizer per loss type), ``entropy_bonus``, ``output`` (``LossOutput``) and
``grpo``, which composes them (``grpo_loss``, ``grpo_loss_with_options``).
"""

from .counts import Count, global_sequence_count, global_token_count
from .grpo import grpo_loss, grpo_loss_with_options
from .masks import high_entropy_mask
from .options import LOSS_TYPES, GRPOLossOptions
from .output import LossOutput

__all__ = [
    "LOSS_TYPES",
    "Count",
    "GRPOLossOptions",
    "LossOutput",
    "global_sequence_count",
    "global_token_count",
    "grpo_loss",
    "grpo_loss_with_options",
    "high_entropy_mask",
]
