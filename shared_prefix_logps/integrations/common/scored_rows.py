"""Rows whose scored tokens a mask marks in the trainer's next-token frame, re-laid as ``[left-padded prompt |
right-padded completion]`` and the results put back.

Trainers that keep whole rows (OpenRLHF's ``Actor.forward``, ms-swift's ``GRPOTrainer``) hand over ``ids`` ``(B, S)``
whose real tokens form one contiguous run per row (right-padded rows, or left-padded ones), and a score mask ``(B, A)``,
``A <= S - 1``, aligned with the last ``A`` of the ``S - 1`` next-token positions: column ``j`` scores token
``S - A + j`` (OpenRLHF's ``action_mask``; ms-swift's ``completion_mask`` with ``A = logits_to_keep``). The scored
tokens may come in several ranges (agent turns with observations between them). The shared prefix of a row is
everything before its first scored token; the completion is the rest of the row's run, observations included (their
log-probs are computed too; the trainer's own forward computes them as well and its losses mask them out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ScoredRows:
    """One batch in the library's trainer-shaped layout, and where its results go back.

    Attributes:
        input_ids: (B, P + C) int64, ``[left-padded prompt | right-padded completion]``.
        attention_mask: (B, P + C) int64 0/1.
        completion_width: C (``logits_to_keep`` of :func:`~shared_prefix_logps.compute_logps_concatenated`).
        rows: (K,) int64 the trainer's row of each valid completion token.
        positions: (K,) int64 its next-token position ``t`` in the trainer's ``(B, S - 1)`` layout.
        columns: (K,) int64 its column in the ``(B, C)`` completion layout.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_width: int
    rows: torch.Tensor
    positions: torch.Tensor
    columns: torch.Tensor


def scored_rows_problem(
    ids, attention_mask, score_mask, *, ids_name: str = "input_ids", score_name: str = "score_mask"
) -> str | None:
    """Why a call's rows cannot be re-laid exactly, or None if they can (checked before serving, to fall back).

    ``ids_name`` and ``score_name`` are the trainer's names of the two tensors, used in the returned reason.
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
        return f"{ids_name} is not a 2-D integer tensor"
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != ids.shape:
        return f"attention_mask is missing or not shaped like {ids_name}"
    if not isinstance(score_mask, torch.Tensor) or score_mask.dim() != 2:
        return f"{score_name} is not a 2-D tensor"
    batch, length = ids.shape
    if batch == 0 or length < 2:
        return "empty batch or rows shorter than two tokens"
    if score_mask.shape[0] != batch or not 1 <= score_mask.shape[1] <= length - 1:
        return f"{score_name} is not (rows, A) with 1 <= A <= sequence length - 1"
    valid = attention_mask != 0
    # one contiguous run of real tokens per row: at most one rising and one falling edge
    edges = (valid[:, 1:] != valid[:, :-1]).sum(dim=1) + valid[:, 0].long() + valid[:, -1].long()
    if bool((edges > 2).any()) or not bool(valid.any(dim=1).all()):
        return "a row's real tokens are not one contiguous run (padding inside a row)"
    scored = _scored_tokens(score_mask, length)
    if bool((scored & ~valid).any()):
        return f"{score_name} marks padding tokens"
    first_valid = valid.long().argmax(dim=1)
    has_scored = scored.any(dim=1)
    first_scored = scored.long().argmax(dim=1)
    if bool((has_scored & (first_scored <= first_valid)).any()):
        return "a scored token has no prompt token before it"
    return None


def _scored_tokens(score_mask: torch.Tensor, length: int) -> torch.Tensor:
    """(B, S) bool: which tokens ``score_mask`` scores (column ``j`` scores token ``S - A + j``)."""
    tokens = torch.zeros((score_mask.shape[0], length), dtype=torch.bool, device=score_mask.device)
    tokens[:, length - score_mask.shape[1] :] = score_mask != 0
    return tokens


def to_prefix_rows(ids, attention_mask, score_mask) -> ScoredRows:
    """Re-lay rows that passed :func:`scored_rows_problem`: prompt = the row's run up to its first scored token (the
    whole run for a row without scored tokens: its completion is empty), completion = the rest of the run."""
    batch, length = ids.shape
    device = ids.device
    valid = attention_mask != 0
    scored = _scored_tokens(score_mask, length)
    start = valid.long().argmax(dim=1)
    end = length - valid.flip(1).long().argmax(dim=1)  # one past the last real token
    split = torch.where(scored.any(dim=1), scored.long().argmax(dim=1), end)
    prompt_len, completion_len = split - start, end - split
    width_p, width_c = int(prompt_len.max()), max(int(completion_len.max()), 1)

    column = torch.arange(length, device=device)
    in_prompt = (column >= start[:, None]) & (column < split[:, None])
    in_completion = (column >= split[:, None]) & (column < end[:, None])
    # target column in the new layout: prompts end at width_p, completions start there
    target = column - split[:, None] + width_p
    keep = in_prompt | in_completion
    row_index = torch.arange(batch, device=device)[:, None].expand(batch, length)

    input_ids = ids.new_zeros((batch, width_p + width_c))
    mask = torch.zeros((batch, width_p + width_c), dtype=torch.long, device=device)
    input_ids[row_index[keep], target[keep]] = ids[keep]
    mask[row_index[keep], target[keep]] = 1

    rows, tokens = in_completion.nonzero(as_tuple=True)
    return ScoredRows(
        input_ids=input_ids,
        attention_mask=mask,
        completion_width=width_c,
        rows=rows,
        positions=tokens - 1,
        columns=tokens - split[rows],
    )


def to_next_token_layout(values: torch.Tensor, rows: ScoredRows, length: int) -> torch.Tensor:
    """(B, C) completion-layout values (log-probs or entropies) as the trainer's ``(B, S - 1)`` next-token layout, 0.0
    at the positions no completion token is predicted from (prompts, padding). Differentiable."""
    out = values.new_zeros((values.shape[0], length - 1))
    out[rows.rows, rows.positions] = values[rows.rows, rows.columns]
    return out
