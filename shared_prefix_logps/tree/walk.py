"""The depth-first walk over a prefix trie shared by ``chunked_backward_tree`` and no-grad ``compute_logps_tree``.

Rows are taken in the depth-first order of the node where they end and cut into chunks (a number of rows, or as many
as fit a token budget). For each chunk, the nodes on its rows' paths that were not forwarded yet go through node
calls (one per depth), each attending over its ancestors' keys/values as *leaves*: tensors cut from the graph that
produced them, which collect the gradient of every descendant. The chunk's log-probs are read from the calls'
log-prob leaves. Once a chunk is done, every call whose nodes no later row passes through, and whose keys/values no
pending call still uses, back-propagates once (with gradients: its outputs with the gradients accumulated on its
leaves, which sends them to the parameters and on to its ancestors' leaves) and is freed. So at most the calls on the
current chunk's paths are alive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..output import LogpsOutput
from .context import TreeContext
from .forward import forward_call
from .lockstep import one_token_zero
from .plan import CallPlanner, scored_pairs


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


class TreeWalk:
    """The depth-first walk of one entry-point call: which node calls are alive, and what each chunk needs.

    ``driver`` runs the backward passes (see ``distributed.backward_driver``); None without gradients. ``packed``
    selects the flex layout of node calls; with ``router_top_k`` each node call's router statistics per node are
    kept in ``node_router``. ``agreement`` (a :class:`~.lockstep.CallAgreement`, with gradients only) keeps every
    node forward and backward in step with the other processes'.
    """

    def __init__(
        self,
        prepared,
        trie,
        rows,
        temperature,
        return_entropy,
        driver,
        packed=False,
        router_top_k=None,
        agreement=None,
    ):
        self.prepared, self.trie, self.rows, self.driver, self.packed = prepared, trie, rows, driver, packed
        self.agreement = agreement
        # (output, leaf) of the one-token forward that stands in for node calls when every row is empty.
        self.placeholder: tuple[torch.Tensor, torch.Tensor] | None = None
        self.router_top_k = router_top_k
        self.node_router: list = []  # (nodes, their router statistics) per node call, when requested
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
        # Row r's scored positions are pairs.of_scored[scored_start[r]:scored_start[r + 1]].
        counts = rows.score_mask.sum(1).cpu()
        self.scored_start = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).tolist()
        self.pair_call = torch.full((self.pairs.target.numel(),), -1, dtype=torch.long)
        self.pair_local = torch.full_like(self.pair_call, -1)

    def chunks(self, *, rows_per_chunk: int | None = None, token_budget: int | None = None) -> list[torch.Tensor]:
        """Row indices per chunk, in the depth-first order of the node each row ends at (empty rows last):
        ``rows_per_chunk`` rows each, or as many as keep the chunk's attention within ``token_budget`` tokens (at
        least one row; see :meth:`attention_tokens`)."""
        ends = self.trie.row_end.clone()
        ends[ends < 0] = self.trie.num_nodes
        order = torch.argsort(ends, stable=True)
        if token_budget is None:
            return list(order.split(rows_per_chunk or max(order.numel(), 1)))
        # Nodes an earlier chunk forwards stay alive for every later row through them: only new nodes cost.
        chunks, current, seen, cost = [], [], set(), 0
        for row in order.tolist():
            new = [node for node in self.paths[row] if node not in seen]
            extra = sum(self.attention_tokens(node) for node in new)
            if current and cost + extra > token_budget:
                chunks.append(torch.tensor(current, dtype=torch.long))
                current, cost = [], 0
            current.append(row)
            seen.update(new)
            cost += extra
        if current:
            chunks.append(torch.tensor(current, dtype=torch.long))
        return chunks

    def attention_tokens(self, node: int) -> int:
        """Keys a node's queries attend over in its call: its ancestors' tokens and its own (the expand layout
        gathers them per node), the measure of a chunk against the token budget."""
        return int(self.trie.node_start[node] + self.trie.node_length[node])

    def forward_chunk(self, chunk: torch.Tensor) -> LogpsOutput:
        """Forward the nodes the chunk's rows need that are not forwarded yet; the chunk's output, differentiable
        through the calls' leaves."""
        new = sorted({node for row in chunk.tolist() for node in self.paths[row] if self.node_call[node] < 0})
        for depth in sorted({int(self.trie.depth[n]) for n in new}):
            self._forward([n for n in new if int(self.trie.depth[n]) == depth])
        score = self.rows.score_mask[chunk.to(self.rows.score_mask.device)]
        of_scored = self.pairs.of_scored
        pairs = torch.cat([of_scored[self.scored_start[r] : self.scored_start[r + 1]] for r in chunk.tolist()])
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
            if self.trie.num_nodes == 0 and self.placeholder is None:
                self._forward_placeholder()
            leaves = [leaf for call in self.calls.values() for leaf in call.leaves]
            if self.placeholder is not None:
                leaves.append(self.placeholder[1])
            anchor = sum(leaf.sum() * 0.0 for leaf in leaves if leaf.requires_grad)
            logps = logps + anchor
            entropy = None if entropy is None else entropy + anchor
        return LogpsOutput(logps, entropy, score)

    def _forward(self, nodes: list[int]) -> None:
        if self.agreement is not None:
            self.agreement.before_forward()
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
            packed=self.packed,
            router_top_k=self.router_top_k,
        )
        if context.router is not None:
            self.node_router.append((list(nodes), context.router))
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

    def _forward_placeholder(self) -> None:
        """Every row is empty, so no node call exists: one one-token forward of the model stands in for them (as the
        dense forward's rows do), so that the chunks' losses back-propagate through the model and every parameter
        gets a zero gradient, as with rows that are not empty."""
        if self.agreement is not None:
            self.agreement.before_forward()
        zero = one_token_zero(self.prepared)
        self.placeholder = (zero, zero.detach().requires_grad_(zero.requires_grad))

    def finish_rows(self, chunk: torch.Tensor) -> None:
        """Count the chunk's rows as done; back-propagate and free every call nothing later needs, descendants
        first (they were planned later), so a call's leaves hold every descendant's gradient when it runs."""
        if self.placeholder is not None and all(not self.paths[row] for row in chunk.tolist()):
            zero, leaf = self.placeholder
            self.placeholder = None
            tensors, grads = ([zero], [leaf.grad]) if leaf.grad is not None else ([], [])
            if self.agreement is not None:
                self.agreement.backward(tensors, grads)
            elif tensors:
                self.driver.tensors(tensors, grads)
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
        if self.agreement is not None:
            self.agreement.backward(tensors, grads)  # also without tensors: the other processes' backward is paired
        elif tensors:
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
