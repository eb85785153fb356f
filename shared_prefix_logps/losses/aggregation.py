"""Aggregation: the per-token loss summed over valid tokens and divided by each loss type's *global* normalizer.

Global-normalized variants (``S`` = sum over the local micro-batch, ``N_tok`` = ``num_items_in_batch``,
``N_seq`` = ``num_sequences_in_batch``, ``L`` = ``max_completion_length``, ``l_i`` = valid tokens of row ``i``,
``B`` = rows of the micro-batch, ``GA`` = accumulation steps, ``W`` = processes, ``SPG`` = steps_per_generation):

=================  ==================================  ===============================================================
loss type          this module (per micro-batch)       TRL 1.16 ``_compute_loss`` (per micro-batch)
=================  ==================================  ===============================================================
dapo/cispo/vespo   ``S_i,t loss_it / N_tok``           ``S_i,t loss_it / (N_gen / W * GA / SPG)``, ``N_gen`` = tokens
                                                       of the generation batch: global already when ``SPG == GA``
bnpo               ``S_i,t loss_it / N_tok`` (= dapo)  ``S_i,t loss_it / (tokens of the micro-batch) / GA``
grpo, sapo         ``S_i (S_t loss_it / l_i) / N_seq`` ``mean_i (S_t loss_it / l_i) / GA``
dr_grpo            ``S_i,t loss_it / (N_seq * L)``     ``S_i,t loss_it / (B * L) / GA``
luspo              ``S_i,t loss_it / N_seq``           ``mean_i (S_t loss_it) / GA``
=================  ==================================  ===============================================================

On one un-split batch (GA = 1, one process, counts = that batch's counts) both columns are equal (the tests check it
against a transcription of TRL's formula); the TRL plug-in's ``micro_batch_counts`` gives the counts under which
``grpo_loss`` reproduces TRL's loss of one micro-batch exactly (e.g. to split that micro-batch into chunks). ``bnpo``
differs from ``dapo`` in TRL only by being normalized per micro-batch; made global, it *is* ``dapo``.

Every normalizer is global, so each micro-batch's share is a plain sum over its rows divided by a constant: the sum
over micro-batches is the full-batch loss whatever the split. The loss is multiplied by ``num_processes`` because
data-parallel engines *average* gradients over processes (see the package docstring).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .counts import as_denominator
from .options import GRPOLossOptions

__all__ = ["SUMS_AND_NORMALIZERS", "aggregate"]

# (masked per-token loss (B, C), maskf (B, C), N_tok, N_seq, options) -> (local sum, global normalizer)
SumAndNormalizer = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | float, torch.Tensor | float, GRPOLossOptions],
    tuple[torch.Tensor, torch.Tensor | float],
]


def _token_mean(masked, maskf, n_tok, n_seq, options):
    """dapo/bnpo/cispo/vespo: every valid token of the step weighs the same."""
    return masked.sum(), n_tok


def _sequence_mean(masked, maskf, n_tok, n_seq, options):
    """grpo/sapo: each row's token mean, then the mean over the step's rows (an empty row counts, with loss 0)."""
    return (masked.sum(-1) / maskf.sum(-1).clamp(min=1.0)).sum(), n_seq


def _fixed_length_mean(masked, maskf, n_tok, n_seq, options):
    """dr_grpo: a constant normalizer (rows x max length), so that no row's tokens weigh more for being short."""
    return masked.sum(), n_seq * options.max_completion_length


def _length_weighted_sequence_mean(masked, maskf, n_tok, n_seq, options):
    """luspo: each row weighted by its length (its token sum), mean over rows."""
    return masked.sum(), n_seq


SUMS_AND_NORMALIZERS: dict[str, SumAndNormalizer] = {
    "grpo": _sequence_mean,
    "bnpo": _token_mean,
    "dr_grpo": _fixed_length_mean,
    "dapo": _token_mean,
    "cispo": _token_mean,
    "sapo": _sequence_mean,
    "luspo": _length_weighted_sequence_mean,
    "vespo": _token_mean,
}


def aggregate(
    per_token_loss: torch.Tensor,
    valid: torch.Tensor,
    maskf: torch.Tensor,
    num_items: torch.Tensor | float,
    num_sequences: torch.Tensor | float,
    options: GRPOLossOptions,
) -> torch.Tensor:
    """The micro-batch's share of the step's loss.

    Args:
        per_token_loss: ``(B, C)``, or ``(B, 1)`` at sequence level with nothing per-token mixed in; loss dtype.
        valid: ``(B, C)`` bool loss mask.
        maskf: ``(B, C)`` the same mask as floats in the loss dtype.
        num_items: global valid-token count ``N_tok`` (tensor or float, see ``counts.resolve_count``).
        num_sequences: global row count ``N_seq``.
        options: ``loss_type`` picks the normalizer; ``num_processes`` multiplies the result.

    Returns:
        0-dim loss in the loss dtype, differentiable.
    """
    # Broadcast a (B, 1) loss against the mask first, so that every loss type sums over valid tokens only; where()
    # rather than a product, so that a non-finite value at padding cannot leak into the sum or its gradient.
    masked = torch.where(valid, per_token_loss.expand_as(maskf), torch.zeros_like(maskf))
    total, count = SUMS_AND_NORMALIZERS[options.loss_type](masked, maskf, num_items, num_sequences, options)
    return total * options.num_processes / as_denominator(count, maskf)
