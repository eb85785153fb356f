"""How no-grad scoring cuts a batch into *scoring batches* whose forwards stay within a token budget.

(Not to be confused with the *generation chunks* of ``chunked_backward`` or the fused head's *row chunks*.)
"""

from __future__ import annotations

import torch

#: Default most tokens forwarded at once when scoring without gradients.
DEFAULT_TOKEN_BUDGET = 32768


def plan_prompt_batches(prompt_mask: torch.Tensor, budget: int | None) -> list[torch.Tensor]:
    """Consecutive prompt indices per Phase 1 scoring batch: each batch's padded prompt tokens fit in ``budget``.

    Args:
        prompt_mask: (num_prompts, P) bool.
        budget: tokens per scoring batch, or None for a single batch.
    Returns:
        list of (k,) int64 index tensors covering every prompt once, in order.
    """
    num_prompts, width = prompt_mask.shape
    per_batch = num_prompts if budget is None else max(1, budget // max(width, 1))
    return list(torch.arange(num_prompts, device=prompt_mask.device).split(per_batch))


def plan_row_batches(completion_mask: torch.Tensor, prefix_cost: int, budget: int | None) -> list[torch.Tensor]:
    """Row indices per Phase 2 scoring batch: ``rows * (C + prefix_cost)`` fits in ``budget``.

    Args:
        completion_mask: (rows, C) bool.
        prefix_cost: tokens each row also pays for its prefix (keys gathered per row by ``expand``; 0 for ``flex``).
        budget: tokens per scoring batch, or None for a single batch.
    """
    rows, width = completion_mask.shape
    per_batch = rows if budget is None else max(1, budget // max(width + prefix_cost, 1))
    return list(torch.arange(rows, device=completion_mask.device).split(per_batch))
