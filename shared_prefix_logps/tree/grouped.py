"""Deeper sharing for the one-level entry points (``compute_logps``, ``compute_logps_concatenated``): when distinct
prompts share a prefix among themselves (a common system prompt), the rows ``[prompt | completion]`` are scored as a
prefix tree, so that prefix is forwarded once instead of once per prompt. Where the prompts share too little, the
one-level path runs as before."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

from ..inputs import GroupedBatch
from ..model import PreparedModel
from ..output import LogpsOutput
from .api import score_tree_rows
from .inputs import TreeRows

#: The tree pass replaces one-level sharing when the trie saves at least this many prompt tokens ...
DEEPER_SHARING_MIN_TOKENS = 64
#: ... and at least this fraction of the tokens one-level sharing forwards (distinct prompts + completion tokens).
#: The tree pass costs one more forward per extra trie depth and its planning; measured on CPU (float32, Qwen2 shape
#: with hidden 256, 2 layers, vocabulary 2000; 8 prompts of a shared system prompt + 64 own tokens, 4 completions of
#: 64 tokens each), its speed relative to one-level sharing was, for 4% / 15% / 25% / 54% of the tokens saved,
#: 0.79 / 0.94 / 1.08 / 1.95 without gradients and 0.93 / 1.11 / 1.20 / 1.56 with them. Not yet measured on a GPU.
DEEPER_SHARING_MIN_FRACTION = 0.2

#: Set inside :func:`one_level_sharing`: the tree pass does not run.
_ONE_LEVEL_ONLY: ContextVar[bool] = ContextVar("one_level_only", default=False)


@contextlib.contextmanager
def one_level_sharing():
    """Within the block, ``compute_logps``/``compute_logps_concatenated`` share each distinct prompt only (one-level
    sharing), whatever the prompts share among themselves: the path they took before deeper sharing, kept for
    comparisons (the benchmark's ``one_level`` method). Results are the same either way; only the work differs."""
    token = _ONE_LEVEL_ONLY.set(True)
    try:
        yield
    finally:
        _ONE_LEVEL_ONLY.reset(token)


def prompt_tokens_saved(batch: GroupedBatch) -> int:
    """Prompt tokens a trie over the distinct prompts forwards fewer than one-level sharing (each prompt once).

    Counted without building the trie: its tokens are the distinct prefixes of the prompts, and with the prompts in
    lexicographic order each prompt adds the tokens past its longest common prefix with the one before it. So the
    saving is the sum of those common prefixes: one sort and one comparison of neighbours, (num_prompts, P) work.
    """
    mask = batch.prompt_mask
    lengths = mask.sum(1)
    width = mask.shape[1]
    inner = torch.arange(width, device=mask.device)
    columns = (width - lengths)[:, None] + inner[None, :]
    past_end = inner[None, :] >= lengths[:, None]
    # Left-justified, -1 after the end: ordered below every token, so a prompt sorts right before its extensions.
    justified = batch.prompt_ids.gather(1, columns.clamp(max=width - 1)).masked_fill(past_end, -1)
    ordered = torch.unique(justified, dim=0)  # sorted rows; a duplicate prompt adds no prefix
    agree = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    common = agree.long().cumprod(1).sum(1)
    return int(lengths.sum()) - int((ordered >= 0).sum()) + int(common.sum())


def deeper_sharing_pays(batch: GroupedBatch) -> bool:
    """Whether the tree pass saves enough prompt tokens over one-level sharing (:data:`DEEPER_SHARING_MIN_TOKENS`,
    :data:`DEEPER_SHARING_MIN_FRACTION`), and may run. Never inside :func:`one_level_sharing`.

    With gradients and several processes it may not: there the trainer plug-ins rely on every call making the same
    two forwards (Phase 1 and Phase 2) on every process, as FSDP's collectives are matched by order, while the tree
    pass makes one forward per trie depth, which depends on the process's own rows. (No-grad calls are joined by the
    plug-ins' lockstep, whatever their number of forwards.)
    """
    if batch.prompt_ids.shape[0] < 2 or _ONE_LEVEL_ONLY.get():
        return False
    if torch.is_grad_enabled() and _several_processes():
        return False
    one_level = int(batch.prompt_mask.sum()) + int(batch.completion_mask.sum())
    return prompt_tokens_saved(batch) >= max(DEEPER_SHARING_MIN_TOKENS, DEEPER_SHARING_MIN_FRACTION * one_level)


def _several_processes() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def grouped_tree_rows(batch: GroupedBatch) -> TreeRows:
    """The rows ``[prompt | completion]`` of ``batch`` as the tree pass takes them, (rows, P + C).

    The rows are left-padded prompt then right-padded completion: their real tokens are contiguous, and each scored
    completion token follows at least one prompt token.
    """
    group = batch.group_index
    prompt_mask = batch.prompt_mask[group]
    ids = torch.cat([batch.prompt_ids[group], batch.completion_ids], dim=1)
    mask = torch.cat([prompt_mask, batch.completion_mask], dim=1)
    score = torch.cat([torch.zeros_like(prompt_mask), batch.completion_mask], dim=1)
    return TreeRows(ids, mask, score, prompt_mask.shape[1] - prompt_mask.sum(1), mask.sum(1))


def score_grouped_as_tree(
    prepared: PreparedModel,
    batch: GroupedBatch,
    rows: TreeRows,
    *,
    temperature: float,
    return_entropy: bool,
    token_budget: int | None,
) -> LogpsOutput:
    """The one-level entry points' result, (rows, C), from the tree pass over ``rows`` (:func:`grouped_tree_rows` of
    ``batch``); the trie of the rows is built there, once."""
    out = score_tree_rows(
        prepared, rows, temperature=temperature, return_entropy=return_entropy, token_budget=token_budget
    )
    width = batch.prompt_ids.shape[1]
    entropy = None if out.entropy is None else out.entropy[:, width:]
    return LogpsOutput(out.logps[:, width:], entropy, batch.completion_mask)
