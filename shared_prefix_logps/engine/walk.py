"""The walk over a plan's chunks of rows: the one loop every entry point runs.

For each chunk, the nodes on its rows' paths that no earlier chunk forwarded go through node calls, one per depth,
each attending over its ancestors' prefix states; the chunk's log-probs are read from the calls' head results.

- Without gradients, once a chunk is done every call whose nodes no later row passes through, and whose states no
  pending call still uses, is freed: at most the calls on the current chunk's paths are alive.
- With gradients and ``leaves`` (the chunked backwards), each call's outputs are cut from the graph that produced them
  into *leaves*, which later calls and the chunks' losses use and which collect the gradient of every descendant.
  Once nothing later needs a call, it back-propagates once (its outputs with the gradients accumulated on its leaves,
  which sends them to the parameters and on to its ancestors' leaves) and is freed. So at most the calls on the
  current chunk's paths are alive, and the result equals autograd of the sum of the chunks' losses.
- With gradients and no leaves (``compute_logps*`` under grad, one chunk), the calls form one graph that the
  caller's backward goes through.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..forward.context import CallSettings
from ..forward.node_call import NodeCall
from ..moe_router import RouterStats, path_sums
from ..output import LogpsOutput, result_zeros
from .call_planner import CallPlanner
from .model_call import CallOutputs, forward_call, one_token_zero
from .plan import Plan
from .recurrent_states import recurrent_call


@dataclass(eq=False)
class _Call:
    """A forwarded node call that is still needed.

    Attributes:
        call: the :class:`~shared_prefix_logps.forward.node_call.NodeCall` (on the host, as planned).
        outputs: the call's :class:`~.model_call.CallOutputs`, as the graph produced them.
        used: what later calls and the chunks read: ``outputs`` themselves, or (with leaves) the same tensors cut
            from the graph, whose gradients accumulate in ``.grad``.
        users: calls that attend over this one's prefix states and have not back-propagated yet.
    """

    call: NodeCall
    outputs: CallOutputs
    used: CallOutputs
    users: set = field(default_factory=set)


class Walk:
    """The walk of one entry-point call over ``plan`` (see the module).

    Args:
        prepared: the prepared model.
        plan: the call's plan (its trie, pairs, results' layout and chunks).
        settings: the entry point's :class:`~shared_prefix_logps.forward.context.CallSettings` (with ``router``, each
            call's router statistics are summed per node: :meth:`router`).
        leaves: cut each call's outputs into leaves and back-propagate calls as they finish (the chunked backwards).
        backward: with ``leaves``, ``backward(tensors, grads)`` runs a call's backward (the driver's ``tensors``, or
            the agreement's ``backward``).
        agreement: with ``leaves`` under lockstep, the :class:`~.lockstep.CallAgreement` whose ``before_forward()``
            runs before each call's forward.
        weight_grads: the entry point's head/embedding weight-gradient buffers (``weight_grads.py``), or None.
        keep_logits_bytes: the fused head keeps each call's logits for its backward up to this size (0: none).
        rerun: how a call that found a non-finite value after an optimistic forward is run again (``rerun(found) ->
            every process runs again``), or None where a call may not run twice: every layer checks instead
            (:func:`~.model_call.forward_call`).
        in_step: the model calls are kept in step with other processes (implied by ``agreement``): with gradients,
            every call's head results join the output of the chunk that forwarded it, also where they are empty
            (see :meth:`forward_rows`).

    With a layout that serves calls of several depths (the layout table's ``multi_depth``) and a plan of one chunk,
    the walk forwards the whole trie in one model call; otherwise one call per depth of each chunk's new nodes. (A
    chunk's call in a plan of several would keep its deeper nodes' activations alive until its shallower ones back-
    propagate, after every chunk; a hybrid's recurrent layers continue each node from its parent's end state, handed
    over between calls.)
    """

    def __init__(
        self,
        prepared,
        plan: Plan,
        settings: CallSettings,
        *,
        leaves: bool = False,
        backward=None,
        agreement=None,
        weight_grads=None,
        keep_logits_bytes: int = 0,
        rerun=None,
        in_step: bool = False,
    ):
        self.prepared, self.plan, self.settings = prepared, plan, settings
        self.leaves, self.backward, self.agreement = leaves, backward, agreement
        self.weight_grads, self.keep_logits_bytes, self.rerun = weight_grads, keep_logits_bytes, rerun
        self.in_step = in_step or agreement is not None
        trie = plan.trie
        self.planner = CallPlanner(trie, plan.pairs, settings.layout)
        self.one_call = self.planner.multi_depth and len(plan.chunks) <= 1 and prepared.recurrent is None
        path = trie.row_path
        # Rows still to be processed through each node: its call may back-propagate (or be freed) once this is 0.
        self.remaining = torch.bincount(path[path >= 0], minlength=trie.num_nodes)
        self.calls: dict[int, _Call] = {}
        # Row r's scored positions are pairs.of_scored[scored_start[r] : scored_start[r] + scored_count[r]].
        self.scored_count = plan.score_mask.sum(1)
        self.scored_start = torch.cumsum(self.scored_count, 0) - self.scored_count
        # Each pair's index among the head results of every call so far, calls in order (int32: one per pair).
        self.pair_position = torch.full((plan.pairs.target.numel(),), -1, dtype=torch.int32)
        self.first_pair: list[int] = []  # per call, the position of its first head result
        self.head_counts: list[int] = []  # per call, its head results
        # (output, what the chunks use) of the one-token forward standing in for node calls when every row is empty.
        self.placeholder: tuple[torch.Tensor, torch.Tensor] | None = None

    def forwards_in_one_chunk(self) -> int:
        """The model forwards :meth:`forward_rows` makes for all of the plan's rows at once with gradients: one node
        call for the whole trie (a layout serving calls of several depths) or one per trie depth (every node lies on
        some row's path), or, when every row is empty, the one-token placeholder (:meth:`_forward_placeholder`).
        Processes agree on this count before they forward."""
        trie = self.plan.trie
        if not trie.num_nodes:
            return 1
        return 1 if self.one_call else int(trie.depth.max())

    def forward_rows(self, rows: torch.Tensor) -> LogpsOutput:
        """Forward the nodes ``rows`` need that are not forwarded yet; the rows' (len(rows), width) output,
        differentiable (through the calls' leaves with ``leaves``)."""
        trie = self.plan.trie
        nodes = trie.row_path[rows].reshape(-1)
        nodes = torch.unique(nodes[nodes >= 0])
        first_new_call = self.planner.num_calls
        new = nodes[self.planner.node_call[nodes] < 0]
        if self.one_call:
            if new.numel():
                self._forward(new)
        else:
            depth = trie.depth[new]
            for level in torch.unique(depth).tolist():
                self._forward(new[depth == level])
        device = self.prepared.device
        score = self.plan.output_mask[rows.to(device, non_blocking=True)]
        counts = self.scored_count[rows]
        pairs = self.plan.pairs.of_scored[
            torch.repeat_interleave(self.scored_start[rows] - (torch.cumsum(counts, 0) - counts), counts)
            + torch.arange(int(counts.sum()))
        ]
        logps = result_zeros(*score.shape, device=device)
        entropy = torch.zeros_like(logps) if self.settings.return_entropy else None
        position = self.pair_position[pairs].long()
        first_pair = torch.tensor(self.first_pair, dtype=torch.long)
        call_of = torch.searchsorted(first_pair, position, right=True) - 1
        calls = torch.unique(call_of).tolist()
        if calls:
            sizes = torch.tensor([self.head_counts[c] for c in calls])
            offsets = torch.zeros(self.planner.num_calls, dtype=torch.long)
            offsets[calls] = torch.cumsum(sizes, 0) - sizes
            index = (offsets[call_of] + position - first_pair[call_of]).to(device, non_blocking=True)
            logps = logps.masked_scatter(score, torch.cat([self.calls[c].used.logps for c in calls])[index])
            if self.settings.return_entropy:
                entropy = entropy.masked_scatter(score, torch.cat([self.calls[c].used.entropy for c in calls])[index])
        elif torch.is_grad_enabled():
            # Nothing scored: a zero result still hangs off the calls' graphs, so that a loss built from it reaches
            # every call's backward (parameters get zero gradients, as from autograd of the one graph). Rows all empty
            # make no call: a one-token forward of the model stands in (as the dense forward's rows do).
            if self.plan.trie.num_nodes == 0 and self.placeholder is None:
                self._forward_placeholder()
            used = [t for call in self.calls.values() for t in call.used.tensors() if t.requires_grad]
            if self.placeholder is not None:
                used.append(self.placeholder[1])
            if used:
                anchor = torch.stack([t.sum() * 0.0 for t in used]).sum()
                logps = logps + anchor
                entropy = None if entropy is None else entropy + anchor
        if torch.is_grad_enabled() and self.in_step:
            # Processes in step must back-propagate every forward and reach the same parameters from each: FSDP2
            # gathers and reduces once per forward graph a backward reaches, and reduces only the gradients that graph
            # produced, so one process's collective would pair with another's next one (a hang). A call's backward
            # reaches every parameter through the zero that enters the model's output, but the head's weight only
            # through the call's head results, which no row reads where the call has no scored pair: a shared system
            # prompt's call (its weight then got no gradient), a call of unscored leaves (its graph got no gradient at
            # all). Their empty sum (exactly zero, connected to the head's weight) joins the chunk's output.
            empty = [self.calls[call].used.logps for call in range(first_new_call, self.planner.num_calls)]
            empty = [result.sum() for result in empty if result.numel() == 0 and result.requires_grad]
            if empty:
                anchor = torch.stack(empty).sum()
                logps = logps + anchor
                entropy = None if entropy is None else entropy + anchor
        return LogpsOutput(logps, entropy, score)

    def router(self, rows: torch.Tensor, num_experts: int) -> RouterStats:
        """The rows' router statistics: the sums of the nodes on each row's path (differentiable through the calls'
        leaves with ``leaves``; the rows' calls must still be alive)."""
        stats = [(c.call.nodes, *c.used.router) for c in self._live()]
        return path_sums(self.plan.trie.row_path[rows], stats, self.plan.trie.num_nodes, num_experts)

    def _live(self) -> list[_Call]:
        return [self.calls[c] for c in sorted(self.calls)]

    def _forward(self, nodes: torch.Tensor) -> None:
        if self.agreement is not None:
            self.agreement.before_forward()
        call = self.planner.plan(nodes)
        call_id = self.planner.num_calls - 1
        for source in call.sources:
            self.calls[source].users.add(call_id)
        outputs = forward_call(
            self.prepared,
            call.to(self.prepared.device),
            [self.calls[source].used.states for source in call.sources],
            self.settings,
            weight_grads=self.weight_grads,
            keep_logits_bytes=self.keep_logits_bytes,
            recurrent=self._recurrent(nodes),
            rerun=self.rerun,
            read_gradients=not self.leaves,
        )
        used = outputs
        if self.leaves:
            used = outputs.from_tensors([t.detach().requires_grad_(t.requires_grad) for t in outputs.tensors()])
        self.calls[call_id] = _Call(call, outputs, used)
        total = self.first_pair[-1] + self.head_counts[-1] if self.first_pair else 0
        self.first_pair.append(total)
        self.head_counts.append(call.head_pairs.numel())
        self.pair_position[call.head_pairs] = torch.arange(total, total + call.head_pairs.numel(), dtype=torch.int32)

    def _recurrent(self, nodes: torch.Tensor):
        """A hybrid's recurrent part of the call over ``nodes`` (each node from its parent's end state), or None."""
        if self.prepared.recurrent is None:
            return None
        planner = self.planner
        return recurrent_call(
            self.plan.trie, nodes, planner.node_call, planner.node_slot, lambda call: self.calls[call].used.ends
        )

    def _forward_placeholder(self) -> None:
        """The one-token forward that stands in for node calls when every row is empty, so that the chunks' losses
        back-propagate through the model and every parameter gets a zero gradient, as with rows that are not."""
        if self.agreement is not None:
            self.agreement.before_forward()
        zero = one_token_zero(self.prepared)
        self.placeholder = (zero, zero.detach().requires_grad_(zero.requires_grad) if self.leaves else zero)

    def finish_rows(self, rows: torch.Tensor) -> None:
        """Count ``rows`` as done; back-propagate (with ``leaves``) and free every call nothing later needs,
        descendants first (they were planned later), so a call's leaves hold every descendant's gradient when it
        runs."""
        if self.placeholder is not None and self.leaves:
            zero, leaf = self.placeholder
            self.placeholder = None
            tensors, grads = ([zero], [leaf.grad]) if leaf.grad is not None else ([], [])
            if tensors or self.agreement is not None:
                self.backward(tensors, grads)
        path = self.plan.trie.row_path[rows]
        self.remaining -= torch.bincount(path[path >= 0], minlength=self.remaining.numel())
        progress = True
        while progress:
            progress = False
            for call_id in sorted(self.calls, reverse=True):
                live = self.calls[call_id]
                if live.users or bool(self.remaining[live.call.nodes].any()):
                    continue
                if self.leaves:
                    self._backward(live)
                for source in live.call.sources:
                    self.calls[source].users.discard(call_id)
                del self.calls[call_id]
                progress = True

    def _backward(self, live: _Call) -> None:
        tensors, grads = [], []
        for output, leaf in zip(live.outputs.tensors(), live.used.tensors()):
            if output.requires_grad and leaf.grad is not None:
                tensors.append(output)
                grads.append(leaf.grad)
        head, head_leaf = live.outputs.logps, live.used.logps
        if self.agreement is not None and tensors and head.requires_grad and head_leaf.grad is None:
            # In step, every backward reaches the head's weight (see forward_rows), also where the loss of the chunk
            # whose output the head results joined was skipped (a loss without grad for a chunk without a valid token).
            tensors.append(head)
            grads.append(torch.zeros_like(head))
        if tensors or self.agreement is not None:  # an agreed backward pairs with the other processes' even if empty
            self.backward(tensors, grads)
