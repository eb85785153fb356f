"""The number of model forwards a grad-enabled scoring walk announces to the other processes
(``Walk.forwards_in_one_chunk``, what ``engine/lockstep.py`` agrees on) is the number it makes, for every shape of
rows: all empty (the placeholder forward), one row, duplicates of one row, flat and deep tries, with and without the
tiny-node rule, and grouped batches (one-token prompts, a shared system prompt, every completion masked).

A process whose announced count is off by one makes one forward more or less than the others, and under DDP or FSDP
the processes' collectives then pair wrongly (a hang). One process suffices to check the count."""

from __future__ import annotations

import pytest
import torch
from support.tiny_models import VOCAB, build_model, make_batch
from support.trees import pad_rows, random_tree_rows, spy_tree_calls

from shared_prefix_logps import compute_logps, compute_logps_tree
from shared_prefix_logps.engine import run


@pytest.fixture
def counted(monkeypatch):
    """(model, walks): a tiny model whose scoring walks record (announced, made) forwards in ``walks``."""
    model = build_model("llama", tied=False)
    made = [0]
    model.register_forward_pre_hook(lambda module, args: made.__setitem__(0, made[0] + 1))
    walks = []

    class CountingWalk(run.Walk):
        def forward_rows(self, rows):
            before = made[0]
            out = super().forward_rows(rows)
            walks.append((self.forwards_in_one_chunk(), made[0] - before))
            return out

    monkeypatch.setattr(run, "Walk", CountingWalk)
    return model, walks


def _rows(kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    if kind == "empty":
        mask = torch.zeros(3, 5, dtype=torch.bool)
        return torch.zeros(3, 5, dtype=torch.long), mask, mask.clone()
    row = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
    if kind == "one_row":
        return pad_rows([row], seed)
    if kind == "duplicates":
        return pad_rows([row] * 3, seed)
    if kind == "flat":
        return pad_rows([torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in (3, 5, 2)], seed)
    return pad_rows(random_tree_rows(seed, depth=int(kind[-1]), branching=2), seed)


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("kind", ["empty", "one_row", "duplicates", "flat", "deep2", "deep3", "deep4"])
def test_tree_walk_makes_the_forwards_it_announces(counted, kind, merge):
    model, walks = counted
    for seed in range(3):
        ids, mask, score = _rows(kind, seed)
        compute_logps_tree(model, ids, mask, score, merge_tiny_nodes=merge).logps.sum().backward()
    assert len(walks) == 3
    for announced, made in walks:
        assert announced == made, walks
    assert {made for _, made in walks} != {0}


def _system_batch(generations: int):
    """Two prompts sharing a 70-token system prompt (the automatic trie pass, engine/sharing.py)."""
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(0, VOCAB, (70,), generator=gen)
    prompts = torch.stack([torch.cat([system, torch.randint(0, VOCAB, (3,), generator=gen)]) for _ in range(2)])
    completions = torch.randint(0, VOCAB, (2 * generations, 4), generator=gen)
    return (
        prompts,
        torch.ones_like(prompts, dtype=torch.bool),
        completions,
        torch.ones_like(completions, dtype=torch.bool),
    )


@pytest.mark.parametrize("kind", ["plain", "one_token", "system", "masked"])
def test_grouped_walk_makes_the_forwards_it_announces(counted, monkeypatch, kind):
    model, walks = counted
    searched = spy_tree_calls(monkeypatch)
    if kind == "system":
        prompts, pmask, comps, cmask = _system_batch(3)
    else:
        prompts, pmask, comps, cmask = make_batch(3, 2, prompt_len=1 if kind == "one_token" else 6, completion_len=4)
        if kind == "masked":
            cmask = torch.zeros_like(cmask)
    out = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    out.logps.sum().backward()
    ((announced, made),) = walks
    assert announced == made
    assert made >= 1
    assert bool(searched) == (kind == "system")  # the system prompt's batch took the searched trie
