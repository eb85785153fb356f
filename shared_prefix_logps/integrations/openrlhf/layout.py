"""OpenRLHF's actor rows re-laid as ``[left-padded prompt | right-padded completion]`` and the results put back.

OpenRLHF's ``Actor.forward(sequences, action_mask, attention_mask)`` takes rows ``(B, S)`` whose real tokens form one
contiguous run (OpenRLHF >= 0.10 right-pads whole rows; older versions left-pad the prompt), and an ``action_mask``
``(B, A)``, ``A <= S - 1``, aligned with the last ``A`` of the ``S - 1`` next-token positions: column ``j`` scores token
``S - A + j``. Actions may come in several ranges (agent turns with observations between them). The shared prefix of a
row is everything before its first action token; the completion is the rest of the row's run, observations included
(their log-probs are computed and then zeroed by ``action_mask``, as OpenRLHF's own forward does).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ActorRows:
    """One batch in the library's trainer-shaped layout, and where its results go back.

    Attributes:
        input_ids: (B, P + C) int64, ``[left-padded prompt | right-padded completion]``.
        attention_mask: (B, P + C) int64 0/1.
        completion_width: C (``logits_to_keep``).
        rows: (K,) int64 the OpenRLHF row of each valid completion token.
        positions: (K,) int64 its next-token position ``t`` in OpenRLHF's ``(B, S - 1)`` log-prob layout.
        columns: (K,) int64 its column in the ``(B, C)`` completion layout.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_width: int
    rows: torch.Tensor
    positions: torch.Tensor
    columns: torch.Tensor


def layout_problem(sequences, attention_mask, action_mask) -> str | None:
    """Why a call's rows cannot be re-laid exactly, or None if they can (checked before serving, to fall back)."""
    if not isinstance(sequences, torch.Tensor) or sequences.dim() != 2 or sequences.dtype.is_floating_point:
        return "sequences is not a 2-D integer tensor"
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != sequences.shape:
        return "attention_mask is missing or not shaped like sequences"
    if not isinstance(action_mask, torch.Tensor) or action_mask.dim() != 2:
        return "action_mask is not a 2-D tensor"
    batch, length = sequences.shape
    if batch == 0 or length < 2:
        return "empty batch or rows shorter than two tokens"
    if action_mask.shape[0] != batch or not 1 <= action_mask.shape[1] <= length - 1:
        return "action_mask is not (rows, A) with 1 <= A <= sequence length - 1"
    valid = attention_mask != 0
    # one contiguous run of real tokens per row: at most one rising and one falling edge
    edges = (valid[:, 1:] != valid[:, :-1]).sum(dim=1) + valid[:, 0].long() + valid[:, -1].long()
    if bool((edges > 2).any()) or not bool(valid.any(dim=1).all()):
        return "a row's real tokens are not one contiguous run (padding inside a row)"
    actions = _action_tokens(action_mask, length)
    if bool((actions & ~valid).any()):
        return "action_mask marks padding tokens"
    first_valid = valid.long().argmax(dim=1)
    has_action = actions.any(dim=1)
    first_action = actions.long().argmax(dim=1)
    if bool((has_action & (first_action <= first_valid)).any()):
        return "an action token has no prompt token before it"
    return None


def _action_tokens(action_mask: torch.Tensor, length: int) -> torch.Tensor:
    """(B, S) bool: which tokens ``action_mask`` scores (column ``j`` scores token ``S - A + j``)."""
    tokens = torch.zeros((action_mask.shape[0], length), dtype=torch.bool, device=action_mask.device)
    tokens[:, length - action_mask.shape[1] :] = action_mask != 0
    return tokens


def to_shared_layout(sequences, attention_mask, action_mask) -> ActorRows:
    """Re-lay rows that passed :func:`layout_problem`: prompt = the row's run up to its first action token (the whole
    run for a row without actions: its completion is empty), completion = the rest of the run."""
    batch, length = sequences.shape
    device = sequences.device
    valid = attention_mask != 0
    actions = _action_tokens(action_mask, length)
    start = valid.long().argmax(dim=1)
    end = length - valid.flip(1).long().argmax(dim=1)  # one past the last real token
    split = torch.where(actions.any(dim=1), actions.long().argmax(dim=1), end)
    prompt_len, completion_len = split - start, end - split
    width_p, width_c = int(prompt_len.max()), max(int(completion_len.max()), 1)

    column = torch.arange(length, device=device)
    in_prompt = (column >= start[:, None]) & (column < split[:, None])
    in_completion = (column >= split[:, None]) & (column < end[:, None])
    # target column in the new layout: prompts end at width_p, completions start there
    target = column - split[:, None] + width_p
    keep = in_prompt | in_completion
    row_index = torch.arange(batch, device=device)[:, None].expand(batch, length)

    input_ids = sequences.new_zeros((batch, width_p + width_c))
    mask = torch.zeros((batch, width_p + width_c), dtype=torch.long, device=device)
    input_ids[row_index[keep], target[keep]] = sequences[keep]
    mask[row_index[keep], target[keep]] = 1

    rows, tokens = in_completion.nonzero(as_tuple=True)
    return ActorRows(
        input_ids=input_ids,
        attention_mask=mask,
        completion_width=width_c,
        rows=rows,
        positions=tokens - 1,
        columns=tokens - split[rows],
    )


def to_actor_layout(values: torch.Tensor, rows: ActorRows, length: int) -> torch.Tensor:
    """(B, C) completion-layout values (log-probs or entropies) as OpenRLHF's ``(B, S - 1)`` next-token layout, 0.0
    at the positions no completion token is predicted from (prompts, padding). Differentiable."""
    out = values.new_zeros((values.shape[0], length - 1))
    out[rows.rows, rows.positions] = values[rows.rows, rows.columns]
    return out
