"""Global counts: the normalizers of the losses, taken over the whole optimizer step (all micro-batches of the
accumulation window, all processes), and their conversion into the denominators the loss divides by."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["Count", "as_denominator", "global_sequence_count", "global_token_count", "resolve_count"]

# A count as callers pass it: a 0-dim tensor (e.g. from ``global_token_count``, possibly float after a division), or a
# Python number.
Count = torch.Tensor | int | float


def _all_reduce_sum(value: torch.Tensor, process_group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=process_group)
    return value


def _as_mask_list(completion_mask: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    masks = [completion_mask] if isinstance(completion_mask, torch.Tensor) else list(completion_mask)
    if not masks:
        raise ValueError("expected at least one completion mask")
    return masks


def global_token_count(completion_mask: torch.Tensor | Sequence[torch.Tensor], *, process_group=None) -> torch.Tensor:
    """Number of valid (loss) tokens over the whole optimizer step: all micro-batches, all processes.

    Args:
        completion_mask: ``(B, C)`` bool/int/float 0-1 loss mask of one micro-batch, or a sequence of such masks
            (the micro-batches of one accumulation window on this process; widths may differ). In TRL terms this
            is ``completion_mask * tool_mask`` (tool-output tokens carry no loss).
        process_group: group to all-reduce over when ``torch.distributed`` is initialized (default: the world).

    Returns:
        0-dim int64 tensor on the first mask's device, identical on every process. It is the ``num_items_in_batch``
        of ``grpo_loss``. Every process must call this collectively (same number of calls, same order). With NCCL
        the masks must be on the GPU.
    """
    masks = _as_mask_list(completion_mask)
    total = torch.zeros((), dtype=torch.int64, device=masks[0].device)
    for mask in masks:
        total += (mask != 0).sum().to(device=total.device)
    return _all_reduce_sum(total, process_group)


def global_sequence_count(
    completion_mask: torch.Tensor | Sequence[torch.Tensor], *, process_group=None
) -> torch.Tensor:
    """Number of rows (completions) over the whole optimizer step: all micro-batches, all processes.

    Rows whose mask is all zero still count, as in TRL (``mask.sum(-1).clamp(min=1)`` then a mean over all rows).

    Args:
        completion_mask: ``(B, C)`` mask of one micro-batch, or a sequence of them (only ``size(0)`` is read).
        process_group: group to all-reduce over when ``torch.distributed`` is initialized.

    Returns:
        0-dim int64 tensor, the ``num_sequences_in_batch`` of ``grpo_loss``.
    """
    masks = _as_mask_list(completion_mask)
    total = torch.tensor(sum(int(m.size(0)) for m in masks), dtype=torch.int64, device=masks[0].device)
    return _all_reduce_sum(total, process_group)


def resolve_count(value: Count | None, fallback: torch.Tensor) -> torch.Tensor | float:
    """A count argument as the loss uses it: ``fallback`` (this micro-batch's own count) when not given, a detached
    tensor (a count never carries gradient), or a Python float."""
    if value is None:
        return fallback
    if isinstance(value, torch.Tensor):
        return value.detach()
    return float(value)


def as_denominator(count: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
    """``count`` as a divisor of a loss shaped like ``like``: on its device, in its dtype, at least 1.

    The floor of 1 keeps a step with no valid token at all (every completion truncated or masked) finite: its loss
    sum is 0 then, and 0 / 1 = 0. Python numbers stay Python floats, so that dividing by them adds no tensor op.
    """
    if isinstance(count, torch.Tensor):
        return count.to(device=like.device, dtype=like.dtype).clamp(min=1.0)
    return max(float(count), 1.0)
