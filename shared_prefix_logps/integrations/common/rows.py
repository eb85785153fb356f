"""Row layouts of trainer batches: checking ``[left-padded prompt | right-padded completion]`` rows, and regrouping
shuffled rows by prompt for ``chunked_backward`` (by group size, or padded to one shape every process agrees on)."""

from __future__ import annotations

import torch

from ...inputs import as_int


def layout_problem(input_ids, attention_mask, logits_to_keep) -> str | None:
    """Why a trainer-shaped batch is not ``[left-padded prompt | right-padded completion]``, or None if it is.

    Checked before calling the shared path so that a batch it cannot serve falls back instead of raising.
    """
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype.is_floating_point:
        return "input_ids is not a 2-D integer tensor"
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        return "attention_mask is missing or not shaped like input_ids"
    try:
        logits_to_keep = as_int("logits_to_keep", logits_to_keep)  # numpy and 0-d tensor integers too
    except TypeError:
        return "logits_to_keep is not an int"
    if not 1 <= logits_to_keep < input_ids.shape[1]:
        return "no prompt columns (logits_to_keep covers the whole row)"
    split = input_ids.shape[1] - logits_to_keep
    valid = attention_mask != 0
    prompt, completion = valid[:, :split], valid[:, split:]
    if input_ids.shape[0] == 0:
        return "empty batch"
    if not bool(prompt[:, -1].all()) or bool((prompt[:, 1:] < prompt[:, :-1]).any()):
        return "a prompt is empty or not left-padded"
    if bool((completion[:, 1:] > completion[:, :-1]).any()):
        return "a completion is not right-padded"
    return None


def regroup_rows(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Group a shuffled micro-batch's rows by identical prompt, bucketed by group size.

    ``chunked_backward`` takes G consecutive completion rows per prompt; a trainer's micro-batch has its rows shuffled
    and may hold only part of a group (groups are split over micro-batches and processes), so group sizes differ.
    Each bucket holds the groups of one size g and is served by one ``chunked_backward`` call with G = g; every
    prompt still goes through the model once.

    Args:
        prompt_ids: (B, P) int64, left-padded. prompt_mask: (B, P) 0/1 or bool.

    Returns:
        List of ``(first_rows, rows)``: ``first_rows`` (n,) int64 one row per prompt of the bucket (its prompt is
        ``prompt_ids[first_rows]``), ``rows`` (n * g,) int64 the micro-batch rows, g consecutive per prompt, in
        their original order within a group.
    """
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)  # pad != any real token id
    _, group = torch.unique(key, dim=0, return_inverse=True)
    sizes = torch.bincount(group)
    row_size = sizes[group]
    # Sort rows by (group size, group), stable: rows of one group become consecutive, in their original order.
    order = torch.argsort(row_size * sizes.numel() + group, stable=True)
    buckets = []
    start = 0
    sorted_sizes = row_size[order].tolist()
    while start < len(sorted_sizes):
        size = sorted_sizes[start]
        count = sorted_sizes.count(size)  # sizes are sorted: this bucket is one contiguous run
        rows = order[start : start + count]
        buckets.append((rows[::size], rows))
        start += count
    return buckets


def padded_groups(lockstep, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """A micro-batch's rows laid out as ``chunked_backward`` wants them, in a shape every process agrees on.

    Rows with identical prompts form a group (shuffled, possibly partial); each group gets G slots, G the largest
    group size on any process, filled with its rows in their order, then masked padding rows. A placeholder group
    follows: a two-token prompt and G rows of one valid token.

    Args:
        lockstep: the processes' agreement (:class:`~.lockstep.Lockstep`; only its ``max`` is used).
        prompt_ids, prompt_mask: (B, P) left-padded; completion_ids, completion_mask: (B, C) right-padded.

    Returns:
        ``(prompts, prompts_mask, completions, completions_mask, slot_rows, generations)``: (k + 1, P') prompts
        (P' = max(P, 2)), ((k + 1) * G, C) completions, ``slot_rows`` ((k + 1) * G,) int64 the micro-batch row in
        each slot or -1 (padding, placeholder), and G.
    """
    device = prompt_ids.device
    rows, width = completion_ids.shape
    key = prompt_ids.masked_fill(prompt_mask == 0, -1)  # pad != any real token id
    _, group = torch.unique(key, dim=0, return_inverse=True)
    sizes = torch.bincount(group)
    groups = sizes.numel()
    generations = lockstep.max(int(sizes.max()))
    order = torch.argsort(group, stable=True)  # rows of each group together, in their original order
    starts = torch.cumsum(sizes, 0) - sizes
    position = torch.arange(rows, device=device) - starts[group[order]]
    slot_rows = torch.full(((groups + 1) * generations,), -1, dtype=torch.long, device=device)
    slot_rows[group[order] * generations + position] = order
    first_rows = order[starts]

    prompt_width = max(prompt_ids.shape[1], 2)
    prompts = prompt_ids.new_zeros((groups + 1, prompt_width))
    prompts_mask = prompt_mask.new_zeros((groups + 1, prompt_width))
    prompts[:groups, prompt_width - prompt_ids.shape[1] :] = prompt_ids[first_rows]
    prompts_mask[:groups, prompt_width - prompt_ids.shape[1] :] = prompt_mask[first_rows]
    prompts_mask[groups, -2:] = 1  # placeholder prompt: two tokens of id 0

    real = slot_rows >= 0
    completions = completion_ids.new_zeros((slot_rows.numel(), width))
    completions_mask = completion_mask.new_zeros((slot_rows.numel(), width))
    completions[real] = completion_ids[slot_rows[real]]
    completions_mask[real] = completion_mask[slot_rows[real]]
    completions_mask[groups * generations :, 0] = 1  # placeholder rows: one valid token each
    return prompts, prompts_mask, completions, completions_mask, slot_rows, generations
