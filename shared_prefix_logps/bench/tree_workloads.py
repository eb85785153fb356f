"""Workloads whose rows share prefixes deeper than one prompt, and the tokens each method forwards on them.

- ``agentic``: prompts that all start with one long system prompt (and tool descriptions), then task tokens of their
  own, G completions each; the completions hold tool-output spans that are not scored.
- ``turns``: multi-turn conversations where each turn is a sample: sample k is sample k-1's prompt, its response and
  the next user message, plus its own response (scored).
- ``forks``: completions of a prompt that fork from each other at random depths (tree rollouts, retries).

Token ids are random; the shapes are what matters. Counts: ``dense`` (every row in full), ``two_level`` (each
distinct prompt part once plus every completion, today's ``compute_logps``), ``tree`` (what ``compute_logps_tree``
forwards: each trie token once) and ``unique`` (the floor: every distinct prefix's last token once). (``compute_logps``
embeds one token fewer per prompt than its count: a prompt's last token goes in with its completions, in place of
their last token, which predicts nothing.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.trie import build_trie


@dataclass(frozen=True)
class TreeWorkload:
    """Rows of a workload, right-padded.

    Attributes:
        name: the preset's name.
        input_ids: (N, L) int64; attention_mask: (N, L) bool; score_mask: (N, L) bool, the scored positions.
        prompt_length: (N,) int64, the tokens of each row that the two-level trie treats as its prompt.
    """

    name: str
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    score_mask: torch.Tensor
    prompt_length: torch.Tensor


def _pack(name: str, rows: list[tuple[list[int], list[bool], int]]) -> TreeWorkload:
    if not rows:
        raise ValueError(f"{name}: no rows (a count of prompts, conversations or completions is 0)")
    width = max(len(tokens) for tokens, _, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    score = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (tokens, scored, _) in enumerate(rows):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens)] = True
        score[i, : len(tokens)] = torch.tensor(scored)
    prompt_length = torch.tensor([p for _, _, p in rows], dtype=torch.long)
    return TreeWorkload(name, ids, mask, score, prompt_length)


def agentic(
    *,
    prompts: int = 16,
    system: int = 2048,
    task: int = 256,
    generations: int = 8,
    completion: int = 512,
    tool_spans: int = 2,
    tool_length: int = 64,
    vocab: int = 32000,
    seed: int = 0,
) -> TreeWorkload:
    """``prompts`` prompts = one shared ``system`` prompt + ``task`` own tokens; ``generations`` completions of
    ``completion`` tokens each, with ``tool_spans`` unscored spans of ``tool_length`` tokens (tool outputs)."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (system,), generator=gen).tolist()
    rows = []
    for _ in range(prompts):
        prompt = shared + torch.randint(0, vocab, (task,), generator=gen).tolist()
        for _ in range(generations):
            tokens = torch.randint(0, vocab, (completion,), generator=gen).tolist()
            scored = [True] * completion
            for span in range(tool_spans):
                start = (span + 1) * completion // (tool_spans + 1)
                scored[start : start + tool_length] = [False] * len(scored[start : start + tool_length])
            rows.append((prompt + tokens, [False] * len(prompt) + scored, len(prompt)))
    return _pack("agentic", rows)


def turns(
    *,
    conversations: int = 4,
    num_turns: int = 4,
    system: int = 512,
    user: int = 128,
    response: int = 256,
    vocab: int = 32000,
    seed: int = 0,
) -> TreeWorkload:
    """``conversations`` conversations of ``num_turns`` turns, each turn a sample scored on its last response only."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, vocab, (system,), generator=gen).tolist()
    rows = []
    for _ in range(conversations):
        history = list(shared)
        for _ in range(num_turns):
            history += torch.randint(0, vocab, (user,), generator=gen).tolist()
            answer = torch.randint(0, vocab, (response,), generator=gen).tolist()
            rows.append((history + answer, [False] * len(history) + [True] * response, len(history)))
            history = history + answer
    return _pack("turns", rows)


def forks(
    *,
    prompts: int = 4,
    prompt_length: int = 1024,
    completions: int = 16,
    completion: int = 512,
    vocab: int = 32000,
    seed: int = 0,
) -> TreeWorkload:
    """``completions`` completions per prompt, each forking from an earlier one of its prompt at a random depth."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(prompts):
        prompt = torch.randint(0, vocab, (prompt_length,), generator=gen).tolist()
        made: list[list[int]] = []
        for _ in range(completions):
            if made:
                parent = made[int(torch.randint(0, len(made), (1,), generator=gen))]
                keep = int(torch.randint(0, completion, (1,), generator=gen))
                tokens = parent[:keep] + torch.randint(0, vocab, (completion - keep,), generator=gen).tolist()
            else:
                tokens = torch.randint(0, vocab, (completion,), generator=gen).tolist()
            made.append(tokens)
            rows.append((prompt + tokens, [False] * prompt_length + [True] * completion, prompt_length))
    return _pack("forks", rows)


WORKLOADS = {"agentic": agentic, "turns": turns, "forks": forks}


def forwarded_tokens(workload: TreeWorkload) -> dict[str, int]:
    """Tokens each method forwards on ``workload``: ``dense``, ``two_level``, ``tree`` and ``unique`` (see the
    module docstring)."""
    lengths = workload.attention_mask.sum(1)
    dense = int(lengths.sum())
    prompts = {tuple(ids[:p].tolist()) for ids, p in zip(workload.input_ids, workload.prompt_length.tolist())}
    two_level = sum(len(p) for p in prompts) + int((lengths - workload.prompt_length).sum())
    trie = build_trie(workload.input_ids, lengths)
    # Every distinct prefix of the rows ends at exactly one trie token (tests/engine/test_trie.py checks it), so the
    # tree forwards exactly the floor.
    return dict(dense=dense, two_level=two_level, tree=trie.num_tokens, unique=trie.num_tokens)
