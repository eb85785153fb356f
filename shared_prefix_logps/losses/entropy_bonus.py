"""The entropy bonus ``entropy_coef * mean entropy``, subtracted from the policy loss (TRL ``entropy_coef``).

Like the policy loss, the mean is over a *global* count of tokens, so the bonus sums over micro-batches to the
full batch's bonus. It is averaged over the valid tokens, or over the ``entropy_mask`` tokens when a high-entropy
mask is in use, whatever the loss type's own normalizer: ``entropy_coef`` means the same for every loss type.
"""

from __future__ import annotations

import torch

from .counts import Count, as_denominator, resolve_count

__all__ = ["entropy_bonus"]


def entropy_bonus(
    entropies: torch.Tensor,
    maskf: torch.Tensor,
    entropy_mask: torch.Tensor | None,
    *,
    entropy_coef: float,
    num_processes: int,
    num_items: torch.Tensor | float,
    num_entropy_items_in_batch: Count | None,
) -> torch.Tensor:
    """The term to subtract from the loss: ``entropy_coef * sum of entropies * num_processes / N_ent``.

    Args:
        entropies: ``(B, C)`` per-token entropies, any float dtype; differentiable (the bonus pushes entropy up).
        maskf: ``(B, C)`` float 0-1 loss mask in the loss dtype.
        entropy_mask: ``(B, C)`` bool high-entropy mask, or None.
        entropy_coef: the coefficient (non-zero: the caller skips the bonus otherwise).
        num_processes: as in ``GRPOLossOptions``: data-parallel engines average gradients.
        num_items: the resolved global valid-token count (``N_tok``); ``N_ent`` without ``entropy_mask``.
        num_entropy_items_in_batch: the global count of bonus tokens ``N_ent`` as passed by the caller, or None: then
            ``num_items`` without ``entropy_mask``, this micro-batch's mask tokens with it (the caller has checked that
            this is an un-split batch then: a local count would not be global).

    Returns:
        0-dim tensor in ``maskf``'s dtype, differentiable through ``entropies``.
    """
    dtype = maskf.dtype
    bonus_mask = maskf if entropy_mask is None else maskf * entropy_mask.to(dtype)
    if num_entropy_items_in_batch is not None:
        n_ent = resolve_count(num_entropy_items_in_batch, num_items)
    elif entropy_mask is None:
        n_ent = num_items
    else:
        n_ent = bonus_mask.sum()
    # where, not multiply: entropies may be NaN at padding
    ent_sum = torch.where(bonus_mask != 0, entropies.to(dtype), torch.zeros_like(maskf)).sum()
    return entropy_coef * ent_sum * num_processes / as_denominator(n_ent, maskf)
