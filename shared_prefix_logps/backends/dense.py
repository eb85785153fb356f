"""The conventional path: every ``[prompt | completion]`` row forwarded in full, plain log-softmax + gather.

It is the reference the shared path is tested against, and the ``backend="dense"`` option. It materializes the
(rows x C x vocab) logits, exactly as trainers do today.
"""

from __future__ import annotations

import torch

from ..inputs import GroupedBatch
from ..model import PreparedModel


def dense_logps(
    prepared: PreparedModel, batch: GroupedBatch, *, temperature: float, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows, C) float32 log-probs (and entropy) of the completion tokens, masked positions set to 0."""
    completion_len = batch.completion_ids.shape[1]
    input_ids = torch.cat([batch.prompt_ids[batch.group_index], batch.completion_ids], dim=1)
    attention_mask = torch.cat([batch.prompt_mask[batch.group_index], batch.completion_mask], dim=1)
    # Positions count real tokens only, as in the shared path (with left padding, arange would shift them).
    position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    # As trainers do: logits only for the last C + 1 positions, the last of which predicts nothing.
    logits = prepared.outer(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=completion_len + 1,
    ).logits
    logits = logits[:, :-1].float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    logps = log_probs.gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    logps = logps.masked_fill(~batch.completion_mask, 0.0)
    entropy = None
    if return_entropy:
        entropy = -(log_probs.exp() * log_probs).sum(-1).masked_fill(~batch.completion_mask, 0.0)
    return logps, entropy
