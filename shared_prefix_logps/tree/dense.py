"""The reference for prefix trees: every row through the model's own forward, plain log-softmax + gather."""

from __future__ import annotations

import torch

from ..model import PreparedModel
from .inputs import TreeRows


def dense_tree_logps(
    prepared: PreparedModel, rows: TreeRows, *, temperature: float, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, L) float32 log-probs (and entropy) at the scored positions of ``rows``, 0 elsewhere.

    Positions count real tokens (``cumsum(attention_mask) - 1``), whatever the padding side; column ``c`` is
    predicted by the logits of column ``c - 1`` (a real token: scored columns follow a row's first real token).
    """
    mask = rows.attention_mask
    position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
    logits = prepared.outer(
        input_ids=rows.input_ids, attention_mask=mask, position_ids=position_ids, use_cache=False
    ).logits
    log_probs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    scored = rows.score_mask[:, 1:]
    logps = torch.zeros(mask.shape, device=logits.device)
    logps[:, 1:] = log_probs.gather(-1, rows.input_ids[:, 1:, None]).squeeze(-1).masked_fill(~scored, 0.0)
    entropy = None
    if return_entropy:
        entropy = torch.zeros_like(logps)
        entropy[:, 1:] = -(log_probs.exp() * log_probs).sum(-1).masked_fill(~scored, 0.0)
    return logps, entropy
