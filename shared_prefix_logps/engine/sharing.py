"""Which trie a grouped batch (``compute_logps``, ``compute_logps_concatenated``, ``chunked_backward``) gets: the
two-level trie of its prompts and completions, built directly, or, when distinct prompts share enough of a prefix
among themselves (a common system prompt), the trie searched from the rows ``[prompt | completion]``, so that prefix
is forwarded once instead of once per prompt."""

from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch

from ..inputs import GroupedBatch, TreeRows

#: The searched trie replaces the two-level one when it saves at least this many prompt tokens ...
DEEPER_SHARING_MIN_TOKENS = 64
#: ... and at least this fraction of the tokens the two-level trie forwards (distinct prompts + completion tokens).
#: A deeper trie costs one more node call per extra depth and its search; measured on CPU (float32, Qwen2 shape with
#: hidden 256, 2 layers, vocabulary 2000; 8 prompts of a shared system prompt + 64 own tokens, 4 completions of 64
#: tokens each), its speed relative to the two-level trie was, for 4% / 15% / 25% / 54% of the tokens saved,
#: 0.79 / 0.94 / 1.08 / 1.95 without gradients and 0.93 / 1.11 / 1.20 / 1.56 with them. Not yet measured on a GPU.
DEEPER_SHARING_MIN_FRACTION = 0.2

#: Set inside :func:`two_level_trie_only`: grouped batches get the two-level trie.
_TWO_LEVEL_ONLY: ContextVar[bool] = ContextVar("two_level_only", default=False)


@contextlib.contextmanager
def two_level_trie_only():
    """Within the block, grouped batches share each distinct prompt only (the two-level trie), whatever the prompts
    share among themselves: kept for comparisons (the benchmark's ``two_level`` method). Results are the same either
    way; only the work differs."""
    token = _TWO_LEVEL_ONLY.set(True)
    try:
        yield
    finally:
        _TWO_LEVEL_ONLY.reset(token)


def prompt_tokens_saved(batch: GroupedBatch) -> int:
    """Prompt tokens a trie over the distinct prompts forwards fewer than the two-level trie (each prompt once).

    Counted without building the trie: its tokens are the distinct prefixes of the prompts, and with the prompts in
    lexicographic order each prompt adds the tokens past its longest common prefix with the one before it. So the
    saving is the sum of those common prefixes: one sort and one comparison of neighbours, (num_prompts, P) work.
    """
    mask = batch.prompt_mask
    lengths = mask.sum(1)
    width = mask.shape[1]
    inner = torch.arange(width)
    columns = (width - lengths)[:, None] + inner[None, :]
    past_end = inner[None, :] >= lengths[:, None]
    # Left-justified, -1 after the end: ordered below every token, so a prompt sorts right before its extensions.
    justified = batch.prompt_ids.gather(1, columns.clamp(max=width - 1)).masked_fill(past_end, -1)
    ordered = torch.unique(justified, dim=0)  # sorted rows; a duplicate prompt adds no prefix
    agree = (ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)
    common = agree.long().cumprod(1).sum(1)
    return int(lengths.sum()) - int((ordered >= 0).sum()) + int(common.sum())


def deeper_sharing_pays(batch: GroupedBatch, *, two_forwards: bool = False) -> bool:
    """Whether the searched trie saves enough prompt tokens over the two-level one (:data:`DEEPER_SHARING_MIN_TOKENS`,
    :data:`DEEPER_SHARING_MIN_FRACTION`). Never inside :func:`two_level_trie_only`, nor with ``two_forwards``: a
    grad-enabled call whose processes agree on nothing themselves (a trainer plug-in keeps them in step) must make the
    same two forwards on every process (FSDP matches collectives by order), which the two-level trie always does."""
    if batch.prompt_ids.shape[0] < 2 or two_forwards or _TWO_LEVEL_ONLY.get():
        return False
    two_level = int(batch.prompt_mask.sum()) + int(batch.completion_mask.sum())
    return prompt_tokens_saved(batch) >= max(DEEPER_SHARING_MIN_TOKENS, DEEPER_SHARING_MIN_FRACTION * two_level)


def grouped_rows(batch: GroupedBatch) -> TreeRows:
    """The rows ``[prompt | completion]`` of ``batch``, (rows, P + C), scored on the completion tokens.

    The rows are left-padded prompt then right-padded completion: their real tokens are contiguous, and each scored
    completion token follows at least one prompt token.
    """
    group = batch.group_index
    prompt_mask = batch.prompt_mask[group]
    ids = torch.cat([batch.prompt_ids[group], batch.completion_ids], dim=1)
    mask = torch.cat([prompt_mask, batch.completion_mask], dim=1)
    score = torch.cat([torch.zeros_like(prompt_mask), batch.completion_mask], dim=1)
    return TreeRows(ids, mask, score, prompt_mask.shape[1] - prompt_mask.sum(1), mask.sum(1))
