"""``chunked_backward_tree``: forward and backward over chunks of rows, walking the trie depth-first, so that peak
memory does not grow with the number of leaves.

Rows are taken in the depth-first order of the node where they end and cut into chunks. For each chunk, the nodes on
its rows' paths that were not forwarded yet go through node calls (one per depth), each attending over its
ancestors' keys/values as *leaves*: tensors cut from the graph that produced them, which collect the gradient of
every descendant. The chunk's log-probs are read from the calls' log-prob leaves, its loss is back-propagated onto
those leaves, and every call whose nodes no later row passes through, and whose keys/values no pending call still
uses, back-propagates once: its outputs with the gradients accumulated on its leaves. That sends the gradient to the
parameters and on to its ancestors' leaves, then frees the call. So at most the calls on the current chunk's paths
are alive: one root-to-leaf path with ``rows_per_chunk=1``. The result equals autograd of the sum of chunk losses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..chunked import _backward_driver, _DeepSpeedBackward
from ..inputs import check_options
from ..model import prepare_model
from ..output import LogpsOutput
from .context import TreeContext
from .forward import forward_call
from .inputs import check_tree_rows
from .plan import CallPlanner, scored_pairs
from .trie import build_trie


@dataclass(eq=False)
class _LiveCall:
    """A forwarded node call whose backward has not run yet.

    Attributes:
        context: the call's context; ``kv``/``logps``/``entropy`` hold the graph's outputs.
        leaves: the same tensors cut from the graph, in the order of :func:`_outputs`; later calls and chunk losses
            use these, so their gradients accumulate in ``.grad``.
        kv_leaves: attention module -> (key, value) leaves, the store descendants' calls attend over.
        users: calls that attend over this one's keys/values and have not back-propagated yet.
    """

    context: TreeContext
    leaves: list
    kv_leaves: dict
    users: set = field(default_factory=set)

    @property
    def logps(self) -> torch.Tensor:
        return self.leaves[len(self.context.kv) * 2]

    @property
    def entropy(self) -> torch.Tensor:
        return self.leaves[len(self.context.kv) * 2 + 1]


def chunked_backward_tree(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    score_mask: torch.Tensor,
    loss_fn: Callable[[LogpsOutput, torch.Tensor], torch.Tensor],
    *,
    rows_per_chunk: int = 1,
    temperature: float = 1.0,
    return_entropy: bool = False,
    backend: str = "auto",
) -> LogpsOutput:
    """Run forward and backward of ``loss_fn`` over chunks of rows of a prefix tree; parameters' ``.grad``
    accumulate the gradient of ``sum(loss_fn(chunk) for chunk)``, as one graph over all rows would give.

    Args:
        model, input_ids, attention_mask, score_mask, temperature, return_entropy: as for
            :func:`~shared_prefix_logps.compute_logps_tree`.
        loss_fn: ``loss_fn(chunk_out, rows) -> scalar tensor``; ``chunk_out`` a differentiable :class:`LogpsOutput`
            of the chunk's rows, (len(rows), L); ``rows`` (len(rows),) int64 their indices in ``input_ids``.
            Normalize with global counts if the sum of chunk losses is to be the batch loss.
        rows_per_chunk: rows per chunk, taken in the depth-first order of the trie (rows that share the most come
            together); memory holds the paths of one chunk's rows.
        backend: ``"auto"`` or ``"expand"``.

    Returns:
        The detached :class:`LogpsOutput` of all rows, (N, L).

    Notes:
        Every chunk calls backward, and every node call once more; under DDP wrap the call in ``no_sync()`` except for
        the step that synchronizes. DeepSpeed engines are not supported here yet.
    """
    check_options(temperature, backend)
    if backend not in ("auto", "expand"):
        raise ValueError(f"chunked_backward_tree supports backend 'auto' or 'expand', got {backend!r}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if isinstance(rows_per_chunk, bool) or not isinstance(rows_per_chunk, int):
        raise TypeError(f"rows_per_chunk must be an int, got {type(rows_per_chunk).__name__}")
    if rows_per_chunk < 1:
        raise ValueError(f"rows_per_chunk must be at least 1, got {rows_per_chunk}")
    if not torch.is_grad_enabled():
        raise RuntimeError("chunked_backward_tree runs backward passes; call it with gradients enabled")
    driver = _backward_driver(model)
    if isinstance(driver, _DeepSpeedBackward):
        raise ValueError("chunked_backward_tree does not run under a DeepSpeed engine yet; use compute_logps_tree")
    prepared = prepare_model(model)
    rows = check_tree_rows(input_ids, attention_mask, score_mask, model=prepared)
    trie = build_trie(rows.justified, rows.lengths)
    walk = _Walk(prepared, trie, rows, float(temperature), return_entropy, driver)
    num_rows, length = rows.score_mask.shape
    logps = torch.zeros(num_rows, length, device=prepared.device)
    entropy = torch.zeros_like(logps) if return_entropy else None
    try:
        for chunk in walk.chunks(rows_per_chunk):
            chunk_out = walk.forward_chunk(chunk)
            loss = loss_fn(chunk_out, chunk.to(prepared.device))
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise TypeError("loss_fn must return a scalar tensor")
            if loss.requires_grad:
                driver.loss(loss, last=False)
            logps[chunk] = chunk_out.logps.detach()
            if return_entropy:
                entropy[chunk] = chunk_out.entropy.detach()
            del chunk_out, loss
            walk.finish_rows(chunk)
        driver.finish()
    finally:
        driver.close()
    return LogpsOutput(logps, entropy, rows.score_mask)


class _Walk:
    """The depth-first walk of one call: which calls are alive, and what each chunk needs."""

    def __init__(self, prepared, trie, rows, temperature, return_entropy, driver):
        self.prepared, self.trie, self.rows, self.driver = prepared, trie, rows, driver
        self.temperature, self.return_entropy = temperature, return_entropy
        self.pairs = scored_pairs(trie, rows)
        self.planner = CallPlanner(trie, self.pairs)
        self.paths = [trie.path(row) for row in range(rows.score_mask.shape[0])]
        # Rows still to be processed through each node: a node's call may back-propagate once this reaches 0.
        self.remaining = [0] * trie.num_nodes
        for path in self.paths:
            for node in path:
                self.remaining[node] += 1
        self.node_call = [-1] * trie.num_nodes
        self.calls: dict[int, _LiveCall] = {}
        self.call_nodes: dict[int, list[int]] = {}
        # Each scored position's pair, and each pair's call and index in that call's results.
        grid = torch.full(rows.score_mask.shape, -1, dtype=torch.long)
        grid[rows.score_mask.cpu()] = self.pairs.of_scored
        self.pair_grid = grid
        self.pair_call = torch.full((self.pairs.target.numel(),), -1, dtype=torch.long)
        self.pair_local = torch.full_like(self.pair_call, -1)

    def chunks(self, rows_per_chunk: int) -> list[torch.Tensor]:
        """Row indices per chunk, in the depth-first order of the node each row ends at (empty rows last)."""
        ends = self.trie.row_end.clone()
        ends[ends < 0] = self.trie.num_nodes
        order = torch.argsort(ends, stable=True)
        return list(order.split(rows_per_chunk))

    def forward_chunk(self, chunk: torch.Tensor) -> LogpsOutput:
        """Forward the nodes the chunk's rows need that are not forwarded yet; the chunk's output, differentiable
        through the calls' leaves."""
        new = sorted({node for row in chunk.tolist() for node in self.paths[row] if self.node_call[node] < 0})
        for depth in sorted({int(self.trie.depth[n]) for n in new}):
            self._forward([n for n in new if int(self.trie.depth[n]) == depth])
        score = self.rows.score_mask[chunk.to(self.rows.score_mask.device)]
        pairs = self.pair_grid[chunk][score.cpu()]
        calls = sorted(set(self.pair_call[pairs].tolist()))
        device = self.prepared.device
        logps = torch.zeros(score.shape, device=device)
        entropy = torch.zeros_like(logps) if self.return_entropy else None
        if calls:
            offsets, running = {}, 0
            for call in calls:
                offsets[call] = running
                running += self.calls[call].context.call.head_pairs.numel()
            index = torch.tensor([offsets[c] for c in self.pair_call[pairs].tolist()], dtype=torch.long)
            index = (index + self.pair_local[pairs]).to(device)
            logps = logps.masked_scatter(score, torch.cat([self.calls[c].logps for c in calls])[index])
            if self.return_entropy:
                entropy = entropy.masked_scatter(score, torch.cat([self.calls[c].entropy for c in calls])[index])
        elif torch.is_grad_enabled():
            # Nothing scored: a zero result still hangs off the walk's leaves, so that a loss built from it reaches
            # every call's backward (parameters get zero gradients, as from autograd of the one graph).
            anchor = sum(leaf.sum() * 0.0 for call in self.calls.values() for leaf in call.leaves if leaf.requires_grad)
            logps = logps + anchor
            entropy = None if entropy is None else entropy + anchor
        return LogpsOutput(logps, entropy, score)

    def _forward(self, nodes: list[int]) -> None:
        call = self.planner.plan(nodes)
        call_id = len(self.planner.call_sizes) - 1
        for source in call.sources:
            self.calls[source].users.add(call_id)
        context = forward_call(
            self.prepared,
            call.to(self.prepared.device),
            [self.calls[source].kv_leaves for source in call.sources],
            temperature=self.temperature,
            return_entropy=self.return_entropy,
        )
        outputs = _outputs(context)
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in outputs]
        modules = list(context.kv)
        kv_leaves = {module: (leaves[2 * i], leaves[2 * i + 1]) for i, module in enumerate(modules)}
        self.calls[call_id] = _LiveCall(context, leaves, kv_leaves)
        self.call_nodes[call_id] = list(nodes)
        for node in nodes:
            self.node_call[node] = call_id
        self.pair_call[call.head_pairs] = call_id
        self.pair_local[call.head_pairs] = torch.arange(call.head_pairs.numel())

    def finish_rows(self, chunk: torch.Tensor) -> None:
        """Count the chunk's rows as done; back-propagate and free every call nothing later needs, descendants
        first (they were planned later), so a call's leaves hold every descendant's gradient when it runs."""
        for row in chunk.tolist():
            for node in self.paths[row]:
                self.remaining[node] -= 1
        progress = True
        while progress:
            progress = False
            for call_id in sorted(self.calls, reverse=True):
                live = self.calls[call_id]
                if live.users or any(self.remaining[n] for n in self.call_nodes[call_id]):
                    continue
                self._backward(call_id, live)
                progress = True

    def _backward(self, call_id: int, live: _LiveCall) -> None:
        outputs = _outputs(live.context)
        tensors, grads = [], []
        for output, leaf in zip(outputs, live.leaves):
            if output.requires_grad and leaf.grad is not None:
                tensors.append(output)
                grads.append(leaf.grad)
        if tensors:
            self.driver.tensors(tensors, grads)
        for source in live.context.call.sources:
            self.calls[source].users.discard(call_id)
        del self.calls[call_id]


def _outputs(context: TreeContext) -> list[torch.Tensor]:
    """What a call hands on, in a fixed order: every layer's key and value, its log-probs, then (when requested)
    its entropy."""
    outputs = [tensor for pair in context.kv.values() for tensor in pair] + [context.logps]
    if context.entropy is not None:
        outputs.append(context.entropy)
    return outputs
