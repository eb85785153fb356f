"""Random batches of rows that form prefix trees, for the tree entry points' tests."""

from __future__ import annotations

import torch

from .tiny_models import VOCAB


def random_tree_rows(seed: int, *, depth: int, branching: int, max_segment: int = 4) -> list[list[int]]:
    """Token-id lists forming a trie of up to ``depth`` levels below a shared system prompt, up to ``branching``
    children per node, segments of 1..``max_segment`` tokens (one-token nodes included). Some rows end inside the
    tree (a row that is a prefix of others), one row is duplicated, one row shares nothing with the rest."""
    gen = torch.Generator().manual_seed(seed)

    def randint(low, high):
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    def tokens(count):
        return torch.randint(0, VOCAB, (count,), generator=gen).tolist()

    rows: list[list[int]] = []

    def grow(prefix: list[int], level: int) -> None:
        path = prefix + tokens(randint(1, max_segment))
        if level == depth:
            rows.append(path)
            return
        if randint(0, 3) == 0:
            rows.append(path)  # ends here although the subtree goes on
        for _ in range(randint(1, branching)):
            grow(path, level + 1)

    system = tokens(randint(2, 6))
    for _ in range(randint(1, 2)):  # prompts that share only the system prompt
        grow(system, 1)
    rows.append(list(rows[randint(0, len(rows) - 1)]))  # a duplicate
    rows.append(tokens(randint(2, 5)))  # shares nothing
    return rows


def pad_rows(rows: list[list[int]], seed: int, *, hole_rate: float = 0.3, extra: int = 1):
    """(ids, attention_mask, score_mask), each (N, L): rows left- or right-padded at random (both kinds present),
    score masks with random holes, never on a row's first real token, at least one scored position."""
    gen = torch.Generator().manual_seed(seed)
    width = max(len(r) for r in rows) + extra
    num = len(rows)
    ids = torch.zeros(num, width, dtype=torch.long)
    mask = torch.zeros(num, width, dtype=torch.bool)
    for i, row in enumerate(rows):
        left = i % 2 == 0 if num > 1 else True
        span = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, span] = torch.tensor(row)
        mask[i, span] = True
    score = mask & (torch.rand(num, width, generator=gen) >= hole_rate)
    first = mask.long().argmax(1)
    score[torch.arange(num), first] = False
    if not score.any():
        score[0, mask[0].nonzero()[-1]] = True
    return ids, mask, score
