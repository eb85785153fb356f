"""Validate and normalize the caller's prompts and completions into one grouped batch.

Every public entry point funnels its inputs through here, so bad input fails early with an error that names the
argument. The values are checked on one host copy of the inputs (:func:`on_host`), where the plan is made too, so that
neither makes the host wait for the device more than once. The plan can rely on two layouts: a
:class:`GroupedBatch` (left-padded prompts, right-padded completions, and for each completion row the index of its
prompt) for ``compute_logps``, ``compute_logps_concatenated`` and ``chunked_backward``, :class:`TreeRows` (rows of any
shape with a score mask) for the tree entry points.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .backends.layouts import LAYOUT_NAMES


@dataclass(frozen=True)
class GroupedBatch:
    """Prompts and the completions that continue them, on the host (what the plan is made from).

    Attributes:
        prompt_ids: (num_prompts, P) int64, left-padded; padded positions hold 0.
        prompt_mask: (num_prompts, P) bool; every row has at least one True and the last column is all True.
        completion_ids: (rows, C) int64, right-padded; padded positions hold 0.
        completion_mask: (rows, C) bool, right-padded (a row may be empty).
        group_index: (rows,) int64 index into the prompts of each completion row.
        output_mask: (rows, C) bool on the model's device, ``completion_mask``'s values: the output's mask (None
            where the batch is only planned, never scored).
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    group_index: torch.Tensor
    output_mask: torch.Tensor | None = None

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """(num_prompts,) int64 true prompt lengths."""
        return self.prompt_mask.sum(1)


@dataclass(frozen=True)
class TreeRows:
    """The caller's rows, validated, on the host (what the plan is made from).

    Attributes:
        input_ids: (N, L) int64 as given, padding replaced by 0.
        attention_mask: (N, L) bool, each row's real tokens one contiguous run.
        score_mask: (N, L) bool, True only on real tokens after each row's first.
        first_column: (N,) int64, column of each row's first real token (0 for an empty row).
        lengths: (N,) int64, real tokens per row.
        output_mask: (N, L) bool on the model's device, ``score_mask``'s values: the output's mask (None for rows the
            library built itself, which only plan).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    score_mask: torch.Tensor
    first_column: torch.Tensor
    lengths: torch.Tensor
    output_mask: torch.Tensor | None = None

    def justified(self) -> torch.Tensor:
        """(N, longest row) int64, each row's real tokens moved to the left (0 after them)."""
        width = int(self.lengths.max())
        inner = torch.arange(width)
        columns = (self.first_column[:, None] + inner[None, :]).clamp(max=max(self.input_ids.shape[1] - 1, 0))
        return self.input_ids.gather(1, columns).masked_fill(inner[None, :] >= self.lengths[:, None], 0)


#: What ``backend=`` may be: ``auto`` (the best layout available on the model's device), every attention layout of the
#: table (``backends/layouts.py``), and ``dense``, the full-row reference.
ATTENTION_BACKENDS = ("auto", *LAYOUT_NAMES, "dense")


def as_number(name: str, value) -> float:
    """``value`` as a Python float: an int or float, a numpy scalar (``np.float32``, ``np.int64``), or a 0-d real
    tensor without gradient. Bools and anything else raise TypeError naming ``name``."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype == torch.bool or value.dtype.is_complex:
            raise TypeError(f"{name} must be a number, got a tensor of shape {tuple(value.shape)} ({value.dtype})")
        if value.requires_grad:
            raise TypeError(f"{name} must be a constant number; a tensor that requires grad would lose its gradient")
        return float(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy registers its scalars as Real
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    return float(value)


def as_int(name: str, value) -> int:
    """``value`` as a Python int: an int, a numpy integer, or a 0-d integer tensor. Bools, floats (even whole) and
    anything else raise TypeError naming ``name``."""
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an int, got a tensor of shape {tuple(value.shape)} ({value.dtype})")
        return int(value.item())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return int(value)


def check_options(temperature, backend, token_budget=None) -> tuple[float, int | None]:
    """Validate the options shared by the entry points; return ``(temperature, token_budget)`` as a Python float and
    a Python int or None (numpy scalars and 0-d tensors are accepted wherever a number is)."""
    temperature = as_number("temperature", temperature)
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if token_budget is not None:
        try:
            budget = as_int("token_budget", token_budget)
        except TypeError:
            budget = 0
        if budget < 1:
            raise ValueError(f"token_budget must be a positive int or None, got {token_budget!r}")
        token_budget = budget
    return temperature, token_budget


def check_has_data(name: str, tensor: torch.Tensor) -> None:
    """Refuse a meta tensor (a shape without data) by ``name``: copying it to the model's device would fail inside
    torch with a message that names no argument."""
    if tensor.is_meta:
        raise ValueError(f"{name} is a meta tensor (a shape without data); pass it on a real device")


def off_host(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives off the host (on an accelerator): reading its values there makes the host wait."""
    return tensor.device.type != "cpu"


def on_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The caller's tensors on the host, through one copy (None stays None; host tensors are returned as they are).

    Every check of the inputs' values and all of the planning run on the host: read on the device, each check would
    be a host sync, a wait for the device's queue to drain (ids in the vocabulary, masks of 0/1 and their padding,
    prompts sharing a prefix, the trie). The device tensors (ids and masks, integer or bool) are cast to int64 and
    concatenated there, copied to the host once, and cut apart there, each back in its dtype.
    """
    moving = [t for t in tensors if t is not None and off_host(t)]
    if not moving:
        return list(tensors)
    flat = torch.cat([t.reshape(-1).to(torch.long) for t in moving]).cpu()
    copies, start = {}, 0
    for t in moving:
        part = flat[start : start + t.numel()].view(t.shape)
        copies[id(t)] = part if t.dtype == torch.long else part.to(t.dtype)
        start += t.numel()
    return [None if t is None else copies.get(id(t), t) for t in tensors]


def _check_id_tensor(name: str, value) -> torch.Tensor | list:
    """A tensor of ids checked for what needs no value (data, dtype, rank), or a list of id lists checked and
    converted to plain ints (the rows)."""
    if isinstance(value, torch.Tensor):
        check_has_data(name, value)
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must hold integer token ids, got dtype {value.dtype}")
        if value.dim() != 2:
            raise ValueError(f"{name} must be 2-D (rows, length), got shape {tuple(value.shape)}")
        return value
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a LongTensor or a list of token-id lists, got {type(value).__name__}")
    rows = []
    for i, row in enumerate(value):
        if isinstance(row, torch.Tensor):
            row = row.tolist()
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise TypeError(f"{name}[{i}] must be a list of token ids, got {type(row).__name__}")
        if not all(type(t) is int for t in row):  # plain ints, the common case, are checked fast
            try:
                row = [as_int(name, t) for t in row]  # numpy integers, 0-d integer tensors
            except TypeError:
                raise TypeError(f"{name}[{i}] must contain only integer token ids") from None
        rows.append(row)
    return rows


def _check_mask_tensor(name: str, mask, shape) -> torch.Tensor:
    """``mask`` checked for what needs no value: a tensor of ``shape``, bool or integer."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(mask).__name__}")
    check_has_data(name, mask)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(mask.shape)} but its ids have shape {tuple(shape)}")
    if mask.dtype != torch.bool and (mask.dtype.is_floating_point or mask.dtype.is_complex):
        raise TypeError(f"{name} must be bool or integer 0/1, got dtype {mask.dtype}")
    return mask


def _host_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """A host copy of a checked mask as bool, once its values are 0/1."""
    if mask.dtype != torch.bool:
        if mask.numel() and not ((mask == 0) | (mask == 1)).all():
            raise ValueError(f"{name} must hold only 0 and 1")
        mask = mask.bool()
    return mask


def device_mask(mask: torch.Tensor, device) -> torch.Tensor:
    """The caller's (checked) mask as a bool tensor on ``device``, the output's mask: no host round trip (a mask
    already there and bool is returned as it is)."""
    return mask.to(device=device, dtype=torch.bool, non_blocking=True)


def _padded_from_lists(rows, *, left: bool):
    """(len(rows), longest) int64 ids and bool mask on the host, each row placed at the right end (``left``
    padding) or at the left end (right padding)."""
    length = max((len(r) for r in rows), default=0)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, row in enumerate(rows):
        if row:
            span = slice(length - len(row), length) if left else slice(0, len(row))
            ids[i, span] = torch.tensor(row, dtype=torch.long)
            mask[i, span] = True
    return ids, mask


def _check_ids_in_vocab(name: str, ids: torch.Tensor, mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Host ``ids`` with every real one in ``[0, vocab_size)``; padded positions may hold anything (pad ids, -100)
    and get a valid id, 0, for the embedding."""
    valid = ids[mask]
    if valid.numel():
        low, high = int(valid.min()), int(valid.max())
        if low < 0 or high >= vocab_size:
            bad = low if low < 0 else high
            raise ValueError(f"{name} holds token id {bad} outside the model's vocabulary [0, {vocab_size})")
    return ids.masked_fill(~mask, 0)


def _prompt_values(ids: torch.Tensor, mask: torch.Tensor, names, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host prompt ids and bool mask checked: left-padded, each prompt non-empty, ids in the vocabulary."""
    ids_name, mask_name = names
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise ValueError(f"{ids_name} is empty (shape {tuple(ids.shape)})")
    if not mask[:, -1].all():
        bad = int((~mask[:, -1]).nonzero()[0])
        raise ValueError(
            f"{mask_name} row {bad} does not end with a real token: prompts must be left-padded and non-empty"
        )
    if (mask[:, 1:] < mask[:, :-1]).any():
        bad = int((mask[:, 1:] < mask[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"{mask_name} row {bad} is not left-padded (a padded position follows a real token)")
    return _check_ids_in_vocab(ids_name, ids, mask, vocab_size), mask


def _completion_values(ids: torch.Tensor, mask: torch.Tensor, names, vocab_size: int):
    """Host completion ids and bool mask checked: right-padded, ids in the vocabulary."""
    ids_name, mask_name = names
    if ids.shape[0] == 0:
        raise ValueError(f"{ids_name} is empty (shape {tuple(ids.shape)})")
    if (mask[:, 1:] > mask[:, :-1]).any():
        bad = int((mask[:, 1:] > mask[:, :-1]).any(1).nonzero()[0])
        raise ValueError(f"{mask_name} row {bad} is not right-padded (a real token follows a padded position)")
    return _check_ids_in_vocab(ids_name, ids, mask, vocab_size), mask


def _checked_part(name: str, value, mask, mask_name: str, *, left: bool):
    """The caller's ids (a tensor or lists) and mask checked for what needs no value: ``(ids tensor or None, mask
    tensor or None, host ids and mask built from lists or None)``."""
    value = _check_id_tensor(name, value)
    if isinstance(value, torch.Tensor):
        if value.shape[0] == 0 or (left and value.shape[1] == 0):
            raise ValueError(f"{name} is empty (shape {tuple(value.shape)})")
        if mask is not None:
            mask = _check_mask_tensor(mask_name, mask, value.shape)
        return value, mask, None
    if mask is not None:
        raise ValueError(f"{mask_name} must be None when {name} is a list of token-id lists")
    if not value:
        raise ValueError(f"{name} is empty")
    if left:
        for i, row in enumerate(value):
            if not row:
                raise ValueError(f"{name}[{i}] is empty; every prompt needs at least one token")
    return None, None, _padded_from_lists(value, left=left)


def group_batch(prompts, completions, prompt_mask, completion_mask, *, model) -> GroupedBatch:
    """Validate the ``compute_logps`` inputs: G = rows // prompts consecutive completions per prompt.

    ``model`` gives the device and vocabulary limits (``device``, ``input_vocab_size``, ``output_vocab_size``:
    a :class:`~shared_prefix_logps.model.PreparedModel`). The values are checked on one host copy of the inputs.
    """
    device, input_vocab_size, output_vocab_size = model.device, model.input_vocab_size, model.output_vocab_size
    prompt_ids, prompt_mask, prompt_lists = _checked_part("prompts", prompts, prompt_mask, "prompt_mask", left=True)
    completion_ids, completion_mask, completion_lists = _checked_part(
        "completions", completions, completion_mask, "completion_mask", left=False
    )
    host = on_host(prompt_ids, prompt_mask, completion_ids, completion_mask)
    if prompt_lists is None:
        ids = host[0].long()
        if ids.shape[0] == 0 or ids.shape[1] == 0:
            raise ValueError(f"prompts is empty (shape {tuple(ids.shape)})")
        mask = torch.ones_like(ids, dtype=torch.bool) if host[1] is None else _host_mask("prompt_mask", host[1])
        prompt_lists = (ids, mask)
    if completion_lists is None:
        ids = host[2].long()
        if ids.shape[0] == 0:
            raise ValueError(f"completions is empty (shape {tuple(ids.shape)})")
        mask = torch.ones_like(ids, dtype=torch.bool) if host[3] is None else _host_mask("completion_mask", host[3])
        output_mask = (
            torch.ones(ids.shape, dtype=torch.bool, device=device)
            if completion_mask is None
            else device_mask(completion_mask, device)
        )
        completion_lists = (ids, mask)
    else:
        output_mask = device_mask(completion_lists[1], device)
    prompt_ids, prompt_mask = _prompt_values(*prompt_lists, ("prompts", "prompt_mask"), input_vocab_size)
    completion_ids, completion_mask = _completion_values(
        *completion_lists, ("completions", "completion_mask"), min(input_vocab_size, output_vocab_size)
    )
    num_prompts, rows = prompt_ids.shape[0], completion_ids.shape[0]
    if rows % num_prompts != 0:
        raise ValueError(
            f"completions has {rows} rows, not a multiple of the {num_prompts} prompts: "
            "G = len(completions) // len(prompts) completions must follow each prompt"
        )
    check_rope_length(model, prompt_ids.shape[1] + completion_ids.shape[1])
    group_index = torch.arange(num_prompts).repeat_interleave(rows // num_prompts)
    return GroupedBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, group_index, output_mask)


def check_rope_length(model, row_width: int) -> None:
    """Refuse rows longer than the model's RoPE serves with length-independent frequencies (see
    :func:`~shared_prefix_logps.model.discovery.rope_length_limit`): there the node calls would rotate a prefix's
    keys and its continuations' queries with other frequencies than the model's full-row forward."""
    limit = getattr(model, "rope_length_limit", None)
    if limit is not None and row_width > limit:
        from .errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"rows of {row_width} tokens (prompt + completion) exceed {limit}, beyond which this model's RoPE "
            "(rope_type 'dynamic' or 'longrope') picks its frequencies from each forward's length; the prompt and "
            "completion passes would not match the model's full-row forward. Shorten the rows or use the dense path"
        )


def split_concatenated(input_ids, attention_mask, logits_to_keep, *, model) -> GroupedBatch:
    """Validate and split trainer-shaped rows ``[left-padded prompt | right-padded completion]``; identical prompts are
    shared.

    Rows whose prompt part (ids under the mask, and the mask) is identical map to one prompt, whatever their order.
    ``model`` gives the device and vocabulary limits, as for :func:`group_batch`; values are checked on the host.
    """
    device, input_vocab_size, output_vocab_size = model.device, model.input_vocab_size, model.output_vocab_size
    ids = _check_id_tensor("input_ids", input_ids)
    if not isinstance(ids, torch.Tensor):
        raise TypeError("input_ids must be a LongTensor (rows, prompt_len + completion_len)")
    logits_to_keep = as_int("logits_to_keep", logits_to_keep)
    if ids.shape[0] == 0:
        raise ValueError("input_ids is empty")
    if not 1 <= logits_to_keep < ids.shape[1]:
        raise ValueError(
            f"logits_to_keep must be in [1, {ids.shape[1] - 1}] so that every row keeps a prompt token, "
            f"got {logits_to_keep}"
        )
    if attention_mask is None:
        raise ValueError("attention_mask is required: masks come from attention masks, never from token ids")
    _check_mask_tensor("attention_mask", attention_mask, ids.shape)
    check_rope_length(model, ids.shape[1])
    split = ids.shape[1] - logits_to_keep
    host_ids, host_mask = on_host(ids, attention_mask)
    mask = _host_mask("attention_mask", host_mask)
    host_ids = host_ids.long()
    # Errors name the caller's arguments and the columns they are about: the prompt part is everything before the
    # last logits_to_keep columns.
    prompt_part = f"[:, :{split}] (the prompt columns, before the last logits_to_keep={logits_to_keep})"
    completion_part = f"[:, {split}:] (the completion columns, the last logits_to_keep={logits_to_keep})"
    prompt_ids, prompt_mask = _prompt_values(
        host_ids[:, :split],
        mask[:, :split],
        ("input_ids" + prompt_part, "attention_mask" + prompt_part),
        input_vocab_size,
    )
    completion_ids, completion_mask = _completion_values(
        host_ids[:, split:],
        mask[:, split:],
        ("input_ids" + completion_part, "attention_mask" + completion_part),
        min(input_vocab_size, output_vocab_size),
    )
    # Padded prompt positions already hold 0; marking them -1 keeps "pad" distinct from a real token 0.
    unique, group_index = torch.unique(prompt_ids.masked_fill(~prompt_mask, -1), dim=0, return_inverse=True)
    unique_mask = unique >= 0
    output_mask = device_mask(attention_mask[:, split:], device)
    return GroupedBatch(unique.clamp(min=0), unique_mask, completion_ids, completion_mask, group_index, output_mask)


def check_tree_rows(input_ids, attention_mask, score_mask, *, model) -> TreeRows:
    """Validate ``input_ids``/``attention_mask``/``score_mask`` (all (N, L)) for ``model`` (a PreparedModel); values
    are checked on one host copy."""
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
    _check_mask_tensor("attention_mask", attention_mask, input_ids.shape)
    _check_mask_tensor("score_mask", score_mask, input_ids.shape)
    ids, mask, scored = on_host(input_ids, attention_mask, score_mask)
    ids = ids.long()
    mask = _host_mask("attention_mask", mask)
    scored = _host_mask("score_mask", scored)
    lengths = mask.sum(1)
    columns = torch.arange(ids.shape[1])
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
    on_first = scored[torch.arange(ids.shape[0]), first] & (lengths > 0)
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
    return TreeRows(ids.masked_fill(~mask, 0), mask, scored, first, lengths, device_mask(score_mask, device))
