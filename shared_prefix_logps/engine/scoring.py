"""How the scoring entry points (``compute_logps``, ``compute_logps_concatenated``, ``compute_logps_tree``) run a
plan: with gradients every row in one chunk (one node call per trie depth, one graph for the caller's backward);
without, chunks of rows within the token budget, each call freed once no later row needs it."""

from __future__ import annotations

import torch

from ..distributed.lockstep import Lockstep
from ..model import PreparedModel
from ..moe_router import RouterStats
from ..output import LogpsOutput, result_zeros
from .budget import DEFAULT_TOKEN_BUDGET, NodeCosts, budgeted_chunks
from .lockstep import agreed_depth_padding
from .plan import Plan
from .walk import Walk


def score_plan(
    prepared: PreparedModel,
    plan: Plan,
    *,
    layout: str,
    temperature: float,
    return_entropy: bool,
    token_budget: int | None = None,
    router: tuple[int, int] | None = None,
    lockstep: Lockstep | None = None,
) -> LogpsOutput:
    """The (rows, width) results of ``plan`` (its order is chosen here).

    Args:
        layout: ``expand``, ``flex`` or ``flash``.
        token_budget: without gradients, the most tokens (memory terms included, :mod:`.budget`) a chunk forwards.
        router: ``(num_experts, top_k)`` to also return each row's router statistics (``out.router``).
        lockstep: keep the model calls in step with the other processes: without gradients the call's forwards are
            joined (:meth:`Lockstep.forwards`); with them the processes agree on the number of node calls.
    """
    if lockstep is not None and not torch.is_grad_enabled():
        with lockstep.forwards(prepared.outer):
            return _score(prepared, plan, layout, temperature, return_entropy, token_budget, router, None)
    return _score(prepared, plan, layout, temperature, return_entropy, token_budget, router, lockstep)


def _score(prepared, plan: Plan, layout, temperature, return_entropy, token_budget, router, lockstep) -> LogpsOutput:
    shape = plan.score_mask.shape
    logps = result_zeros(*shape, device=prepared.device)
    entropy = torch.zeros_like(logps) if return_entropy else None
    grad = torch.is_grad_enabled()
    if grad:
        plan = plan.in_one_chunk()
    else:
        rows = plan.depth_first_rows()
        if router is None:  # a row without a scored position needs no forward
            rows = rows[plan.score_mask.sum(1).cpu()[rows] > 0]
        costs = NodeCosts.of(prepared.causal_lm, prepared.device, layout)
        plan = plan.ordered(budgeted_chunks(plan.trie, rows, token_budget or DEFAULT_TOKEN_BUDGET, costs))
    top_k = None if router is None else router[1]
    walk = Walk(
        prepared,
        plan,
        layout=layout,
        temperature=temperature,
        return_entropy=return_entropy,
        router_top_k=top_k,
        in_step=lockstep is not None,
    )
    padding = None
    if grad and lockstep is not None:
        padding = agreed_depth_padding(lockstep, prepared, walk.forwards_in_one_chunk())
    routed = []
    for chunk in plan.chunks:
        out = walk.forward_rows(chunk)
        if router is not None:
            routed.append(walk.router(chunk, router[0]))
        if grad:  # one chunk of every row, in order
            logps, entropy = out.logps, out.entropy
        else:
            logps[chunk] = out.logps
            if return_entropy:
                entropy[chunk] = out.entropy
        walk.finish_rows(chunk)
    if padding is not None:  # the other processes' extra node calls, matched here by one-token forwards
        logps = logps + padding
        entropy = None if entropy is None else entropy + padding
    result = LogpsOutput(logps, entropy, plan.score_mask)
    if router is not None:
        result.router = _in_row_order(plan.chunks, routed, router[0], prepared.device, plan.num_rows)
    return result


def _in_row_order(chunks, stats: list[RouterStats], num_experts: int, device, rows: int) -> RouterStats:
    """Per-chunk router statistics put back in row order (every row is in exactly one chunk)."""
    if not stats:
        zeros = result_zeros(rows, num_experts, device=device)
        return RouterStats(zeros, zeros.clone(), result_zeros(rows, device=device), num_experts)
    order = torch.argsort(torch.cat(list(chunks))).to(device)
    fields = (torch.cat([getattr(s, name) for s in stats])[order] for name in ("counts", "probs", "tokens"))
    return RouterStats(*fields, num_experts)
