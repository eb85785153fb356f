"""Validation of the tree entry points' inputs; errors name the argument and say what to do."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..inputs import check_has_data, check_mask, check_rope_length


@dataclass(frozen=True)
class TreeRows:
    """The caller's rows, validated.

    Attributes:
        input_ids: (N, L) int64 as given, padding replaced by 0.
        attention_mask: (N, L) bool, each row's real tokens one contiguous run.
        score_mask: (N, L) bool, True only on real tokens after each row's first.
        first_column: (N,) int64, column of each row's first real token (0 for an empty row).
        lengths: (N,) int64, real tokens per row.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    score_mask: torch.Tensor
    first_column: torch.Tensor
    lengths: torch.Tensor

    def justified(self) -> torch.Tensor:
        """(N, longest row) int64, each row's real tokens moved to the left (0 after them)."""
        width = int(self.lengths.max())
        inner = torch.arange(width, device=self.input_ids.device)
        columns = (self.first_column[:, None] + inner[None, :]).clamp(max=max(self.input_ids.shape[1] - 1, 0))
        return self.input_ids.gather(1, columns).masked_fill(inner[None, :] >= self.lengths[:, None], 0)


def check_tree_rows(input_ids, attention_mask, score_mask, *, model) -> TreeRows:
    """Validate ``input_ids``/``attention_mask``/``score_mask`` (all (N, L)) for ``model`` (a PreparedModel)."""
    device = model.device
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a LongTensor (rows, length), got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"input_ids must be 2-D (rows, length) with at least one row, got {tuple(input_ids.shape)}")
    if input_ids.shape[1] == 0:
        raise ValueError(f"input_ids has no columns, shape {tuple(input_ids.shape)}: rows need at least one position")
    if attention_mask is None:
        raise ValueError("attention_mask is required: masks come from attention masks, never from token ids")
    if score_mask is None:
        raise ValueError("score_mask is required: True at the positions whose log-prob is wanted")
    check_has_data("input_ids", input_ids)  # the masks' are checked with their shapes
    ids = input_ids.to(device=device, dtype=torch.long)
    mask = check_mask("attention_mask", attention_mask, ids.shape, device)
    scored = check_mask("score_mask", score_mask, ids.shape, device)
    lengths = mask.sum(1)
    columns = torch.arange(ids.shape[1], device=device)
    first = torch.where(lengths > 0, mask.long().argmax(1), torch.zeros_like(lengths))
    inside = (columns[None, :] >= first[:, None]) & (columns[None, :] < (first + lengths)[:, None])
    if not torch.equal(inside, mask):
        bad = int((inside != mask).any(1).nonzero()[0])
        raise ValueError(
            f"attention_mask row {bad} is not contiguous: each row's real tokens must form one run (left- or "
            "right-padded, no padding between real tokens)"
        )
    on_padding = scored & ~mask
    if on_padding.any():
        row, column = (int(v) for v in on_padding.nonzero()[0])
        raise ValueError(f"score_mask row {row} scores column {column}, which is padding in attention_mask")
    on_first = scored[torch.arange(ids.shape[0], device=device), first] & (lengths > 0)
    if on_first.any():
        row = int(on_first.nonzero()[0])
        raise ValueError(
            f"score_mask row {row} scores column {int(first[row])}, the row's first real token: nothing precedes it "
            "to condition its log-prob on; leave it unscored"
        )
    vocab = model.input_vocab_size
    real = ids[mask]
    if real.numel() and (int(real.min()) < 0 or int(real.max()) >= vocab):
        bad = int(real.min()) if int(real.min()) < 0 else int(real.max())
        raise ValueError(f"input_ids holds token id {bad} outside the model's vocabulary [0, {vocab})")
    targets = ids[scored]
    if targets.numel() and int(targets.max()) >= model.output_vocab_size:
        raise ValueError(
            f"input_ids scores token id {int(targets.max())} outside the lm_head's vocabulary "
            f"[0, {model.output_vocab_size})"
        )
    check_rope_length(model, int(lengths.max()))
    return TreeRows(ids.masked_fill(~mask, 0), mask, scored, first, lengths)
