"""How a plan runs, for every entry point: the order of its chunks, the walk over them, and the results in row order.

- Scoring (``compute_logps``, ``compute_logps_concatenated``, ``compute_logps_tree``; :func:`score_plan`): with
  gradients every row in one chunk (one node call per trie depth, one graph for the caller's backward); without,
  chunks of rows within the token budget, each call freed once no later row needs it.
- Training (``chunked_backward``, ``chunked_backward_tree``; :func:`train_plan`): the plan's chunks in the order the
  entry point chose, forward and backward through the walk with leaves: each chunk forwards the node calls its rows
  need, its loss is back-propagated onto the calls' leaves, and each node call back-propagates once every row below
  it is done. The result equals autograd of the sum of the chunk losses.

A grouped batch's plan is made here too (:func:`grouped_call_plan`), for the scoring and the training entry points
alike.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..distributed.backward_driver import backward_chunk_loss
from ..distributed.lockstep import Lockstep, collective_wrapper
from ..forward.context import CallSettings
from ..inputs import GroupedBatch
from ..kernels.fused_head import keep_logits_bytes
from ..model import PreparedModel
from ..moe_router import RouterStats, in_row_order
from ..output import LogpsOutput, result_zeros
from . import merge
from .budget import DEFAULT_TOKEN_BUDGET, NodeCosts, budgeted_chunks
from .grad_accumulation import AccumulatingDriver, grad_accumulation
from .lockstep import CallAgreement, agreed_depth_padding
from .plan import Plan, grouped_plan, one_token_forks
from .sharing import deeper_sharing_pays
from .walk import Walk
from .weight_grads import weight_grads


def grouped_call_plan(batch: GroupedBatch, prepared: PreparedModel, steps: Lockstep | None) -> Plan:
    """The plan (without an order) of a grouped batch: the trie searched from its rows where distinct prompts share
    enough (:mod:`.sharing`) and the processes may make other calls than two forwards (:func:`two_forwards_only`),
    else its two-level trie."""
    deeper = deeper_sharing_pays(batch, two_forwards=two_forwards_only(steps))
    return grouped_plan(
        batch, deeper=deeper, merge_below=merge.MERGE_BELOW_SAVED_TOKENS, one_token_forks=one_token_forks(prepared)
    )


def two_forwards_only(steps: Lockstep | None) -> bool:
    """Whether a grouped call must make the same forwards as every other process without agreeing on them (with
    gradients, several processes and no agreement of its own ``steps``: a trainer plug-in keeps the processes in step
    and relies on it): the two-level trie then serves it, two node calls (one when no completion has a token)."""
    if not torch.is_grad_enabled() or steps is not None:
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def score_plan(
    prepared: PreparedModel,
    plan: Plan,
    settings: CallSettings,
    *,
    token_budget: int | None = None,
    lockstep: Lockstep | None = None,
) -> LogpsOutput:
    """The (rows, width) results of ``plan`` (its order is chosen here).

    Args:
        settings: the calls' :class:`~shared_prefix_logps.forward.context.CallSettings` (with ``router``, each row's
            router statistics are returned too: ``out.router``).
        token_budget: without gradients, the most tokens (memory terms included, :mod:`.budget`) a chunk forwards.
        lockstep: keep the model calls in step with the other processes: without gradients the call's forwards are
            joined (:meth:`Lockstep.forwards`); with them the processes agree on the number of node calls.
    """
    if lockstep is not None and not torch.is_grad_enabled():
        with lockstep.forwards(prepared.outer):
            return _score(prepared, plan, settings, token_budget, None, joined=True)
    return _score(prepared, plan, settings, token_budget, lockstep)


def _score(prepared, plan: Plan, settings: CallSettings, token_budget, lockstep, *, joined=False) -> LogpsOutput:
    grad = torch.is_grad_enabled()
    if grad:
        plan = plan.in_one_chunk()
    else:
        rows = plan.depth_first_rows()
        if settings.router is None:  # a row without a scored position needs no forward
            rows = rows[plan.score_mask.sum(1)[rows] > 0]
        costs = NodeCosts.of(prepared.causal_lm, prepared.device, settings.layout)
        plan = plan.ordered(budgeted_chunks(plan.trie, rows, token_budget or DEFAULT_TOKEN_BUDGET, costs))
    # A call may run again (optimistically, see model_call) where no collective pairs it with other processes' calls:
    # a model without a collective wrapper, or no-grad calls whose forwards lockstep joins.
    rerun = _run_again if joined or collective_wrapper(prepared.outer) is None else None
    walk = Walk(prepared, plan, settings, rerun=rerun, in_step=lockstep is not None)
    padding = None
    if grad and lockstep is not None:
        padding = agreed_depth_padding(lockstep, prepared, walk.forwards_in_one_chunk())
    results = _Results(plan, settings, prepared.device)
    for chunk in plan.chunks:
        out = walk.forward_rows(chunk)
        if settings.router is not None:
            out.router = walk.router(chunk, settings.router[0])
        results.add(chunk, out, whole=grad)  # with gradients: one chunk of every row, in order, kept in the graph
        walk.finish_rows(chunk)
    result = results.output()
    if padding is not None:  # the other processes' extra node calls, matched here by one-token forwards
        result.logps = result.logps + padding
        result.entropy = None if result.entropy is None else result.entropy + padding
    return result


def train_plan(prepared: PreparedModel, plan: Plan, settings: CallSettings, loss_fn, *, driver, steps) -> LogpsOutput:
    """Forward and backward ``plan``'s chunks in order (see the module); the detached (rows, width) output.

    ``settings``: the calls' (with ``router``, each chunk's output gets its rows' router statistics); ``loss_fn``:
    ``loss_fn(chunk_out, rows) -> scalar`` as for the chunked backwards; ``driver`` runs the backward passes
    (``distributed/backward_driver.py``); ``steps``: the processes' agreement (every node forward and backward agreed
    first), or None."""
    grads = weight_grads(prepared, driver)
    accumulation = grad_accumulation(prepared, driver, {id(p) for p in grads.parameters()} if grads else set())
    if accumulation is not None:
        driver = AccumulatingDriver(driver, accumulation)
    agreement = None if steps is None else CallAgreement(steps, prepared, driver)
    walk = Walk(
        prepared,
        plan,
        settings,
        rerun=_run_again if collective_wrapper(prepared.outer) is None else None,
        leaves=True,
        backward=driver.tensors if agreement is None else agreement.backward,
        agreement=agreement,
        weight_grads=grads,
        keep_logits_bytes=keep_logits_bytes(prepared.device),
    )
    results = _Results(plan, settings, prepared.device)
    with accumulation.installed() if accumulation is not None else contextlib.nullcontext():
        try:
            driver.begin()  # under DDP: every backward local, the gradients averaged once by driver.finish()
            for chunk in plan.chunks:
                chunk_out = walk.forward_rows(chunk)
                if settings.router is not None:
                    chunk_out.router = walk.router(chunk, settings.router[0])
                loss = loss_fn(chunk_out, chunk.to(prepared.device, non_blocking=True))
                backward_chunk_loss(
                    driver,
                    loss,
                    chunk_rows=chunk,
                    has_valid=bool(plan.score_mask[chunk].any()),
                    logps_need_grad=chunk_out.logps.requires_grad,
                )
                results.add(chunk, chunk_out.detach())
                del chunk_out, loss
                walk.finish_rows(chunk)
            if grads is not None:
                grads.deliver()
            if agreement is not None:
                agreement.finish()
            driver.finish()
        finally:
            driver.close()
    return results.output()


def _run_again(found: bool) -> bool:
    """A process on its own runs a call again when it found a non-finite value (see ``model_call.forward_call``)."""
    return found


class _Results:
    """The (rows, width) results of a plan's chunks, gathered chunk by chunk into row order."""

    def __init__(self, plan: Plan, settings: CallSettings, device):
        self.plan, self.settings, self.device = plan, settings, device
        self.logps = result_zeros(*plan.score_mask.shape, device=device)
        self.entropy = torch.zeros_like(self.logps) if settings.return_entropy else None
        self.rows: list[torch.Tensor] = []
        self.routed: list[RouterStats] = []

    def add(self, chunk: torch.Tensor, out: LogpsOutput, *, whole: bool = False) -> None:
        """The output of the rows ``chunk`` ((k,) int64); ``whole``: the chunk is every row in order, and its tensors
        are taken as they are (in the graph), not copied in."""
        if whole:
            self.logps, self.entropy = out.logps, out.entropy
        else:
            self.logps[chunk] = out.logps
            if self.entropy is not None:
                self.entropy[chunk] = out.entropy
        if out.router is not None:
            self.rows.append(chunk)
            self.routed.append(out.router)

    def output(self) -> LogpsOutput:
        result = LogpsOutput(self.logps, self.entropy, self.plan.output_mask)
        if self.settings.router is not None:
            result.router = in_row_order(
                self.rows, self.routed, self.settings.router[0], rows=self.plan.num_rows, device=self.device
            )
        return result
