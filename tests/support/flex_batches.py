"""Packed flex batches as the backend's mask builders see them (the attributes of the phase contexts they read),
without a model: random ones with their own description of who sees whom, and a large regular one."""

from __future__ import annotations

import types

import torch


def random_packed_batch(seed: int, device="cpu"):
    """A packed Phase 2 structure as the flex backend sees it, plus its own description of who sees whom.

    Prompts with prefixes of 0 (a one-token prompt) to 300 tokens, 1 to 4 generations, completion rows of 0 to 200
    tokens, rows assigned to prompts in random order (trainer-shaped batches share prompts whatever their order).
    """
    gen = torch.Generator().manual_seed(seed)
    num_prompts = int(torch.randint(1, 5, (), generator=gen))
    generations = int(torch.randint(1, 5, (), generator=gen))
    prefix = torch.randint(0, 301, (num_prompts,), generator=gen)
    prefix[0] = 0 if seed % 3 == 0 else prefix[0]
    num_rows = num_prompts * generations
    group = torch.randint(0, num_prompts, (num_rows,), generator=gen)
    length = torch.randint(0, 201, (num_rows,), generator=gen)
    length[0] = max(1, int(length[0]))
    capture = types.SimpleNamespace(
        segments=torch.arange(num_prompts).repeat_interleave(prefix),
        positions=torch.cat([torch.arange(int(n)) for n in prefix])[None],
        kv_of=lambda module: (None, None),
    )
    rows = torch.arange(num_rows).repeat_interleave(length)
    positions = torch.cat([prefix[g] + torch.arange(int(n)) for g, n in zip(group, length)])
    context = types.SimpleNamespace(
        capture=capture if int(prefix.sum()) else None,
        query_rows=rows,
        group_index=group,
        positions=positions[None],
        needs_grad=False,
        masks={},
    )
    return _to(context, device), int(prefix.sum())


def expected_visibility(context, num_prefix, q_len, kv_len, window):
    """(q_len, kv_len) bool from the batch's meaning, independent of the mask function: a completion token sees its
    prompt's whole prefix and its own row's earlier tokens, within the window."""
    rows, positions = context.query_rows, context.positions[0]
    n = rows.numel()
    if context.capture is not None:
        k_group = torch.cat([context.capture.segments, context.group_index[rows]])
        k_row = torch.cat([torch.full((num_prefix,), -1), rows])
        k_pos = torch.cat([context.capture.positions[0], positions])
    else:
        k_group, k_row, k_pos = context.group_index[rows], rows, positions
    k_index = torch.arange(k_row.numel())
    q_group, q_row = context.group_index[rows][:, None], rows[:, None]
    own = (k_row[None] == q_row) & (k_index[None] - num_prefix <= torch.arange(n)[:, None])
    seen = (k_group[None] == q_group) & ((k_row[None] < 0) | own)
    if window is not None:
        seen &= positions[:, None] - k_pos[None] < window
    expected = torch.zeros(q_len, kv_len, dtype=torch.bool)
    expected[:n, : k_row.numel()] = seen
    return expected


def regular_packed_batch(prompts: int, prefix: int, generations: int, completion: int, device="cpu"):
    """A packed Phase 2 structure of ``prompts`` prompts of ``prefix`` tokens, each with ``generations`` rows of
    ``completion`` tokens, and a capture holding one-element keys (the mask depends on the structure only)."""
    rows = prompts * generations
    capture = types.SimpleNamespace(
        segments=torch.arange(prompts).repeat_interleave(prefix),
        positions=torch.arange(prefix).repeat(prompts)[None],
        needs_grad=False,
    )
    prefix_kv = torch.zeros(1, 1, prompts * prefix, 1, device=device)
    capture.kv_of = lambda module: (prefix_kv, prefix_kv)
    context = types.SimpleNamespace(
        capture=capture,
        query_rows=torch.arange(rows).repeat_interleave(completion),
        group_index=torch.arange(prompts).repeat_interleave(generations),
        positions=(prefix + torch.arange(completion)).repeat(rows)[None],
        needs_grad=False,
        masks={},
    )
    return _to(context, device)


def _to(context, device):
    """``context`` with its tensors (and its capture's) moved to ``device``."""
    for holder in (context, getattr(context, "capture", None)):
        if holder is None:
            continue
        for name, value in vars(holder).items():
            if isinstance(value, torch.Tensor):
                setattr(holder, name, value.to(device))
    return context
