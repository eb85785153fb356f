"""The reference every entry point's ``backend="dense"`` runs and every test compares against: each row through the
model's own forward, plain log-softmax + gather. It materializes the (rows x scored columns x vocab) logits, as
trainers do today."""

from __future__ import annotations

import torch

from ..inputs import TreeRows
from ..model import PreparedModel
from ..output import result_zeros


def dense_logps(
    prepared: PreparedModel, rows: TreeRows, *, temperature: float, return_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, L) float32 log-probs (and entropy) at the scored positions of ``rows``, 0 elsewhere.

    Positions count real tokens (``cumsum(attention_mask) - 1``), whatever the padding side; column ``c`` is
    predicted by the logits of column ``c - 1`` (a real token: scored columns follow a row's first real token). As
    trainers do, logits are computed only from the column before the first scored one on.
    """
    device = prepared.device
    width = rows.attention_mask.shape[1]
    scored_columns = rows.score_mask.any(0).nonzero()
    first = int(scored_columns[0]) if scored_columns.numel() else width
    ids, mask, score = (t.to(device, non_blocking=True) for t in (rows.input_ids, rows.attention_mask, rows.score_mask))
    position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
    logits = prepared.outer(
        input_ids=ids,
        attention_mask=mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=width - first + 1,
    ).logits
    log_probs = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
    scored = score[:, first:]
    logps = result_zeros(*mask.shape, device=logits.device)
    targets = ids[:, first:, None]
    logps[:, first:] = log_probs.gather(-1, targets).squeeze(-1).masked_fill(~scored, 0.0)
    entropy = None
    if return_entropy:
        entropy = torch.zeros_like(logps)
        entropy[:, first:] = -(log_probs.exp() * log_probs).sum(-1).masked_fill(~scored, 0.0)
    return logps, entropy
