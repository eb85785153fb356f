"""The engine's call planner: scored pairs, and node call after node call of one trie, each one's packed tokens,
positions, the ancestors each node attends over and the pairs its head scores (:class:`~..forward.node_call.NodeCall`).

A *scored pair* is (trie token whose last-layer hidden state predicts, target token). Every scored position of every
row maps to one: the row's real token ``j`` is predicted by its token ``j - 1``. Inside a node the next token is
unique; the last token of a node predicts the first token of each child (a prompt's last token predicts each
completion's first token). Rows sharing a path share its pairs, so each pair goes through the fused head once,
whatever the number of rows that score it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..backends import layouts
from ..backends.layouts import layout_module
from ..forward.node_call import FlashLevel, NodeCall
from .trie import PrefixTrie


@dataclass(frozen=True)
class ScoredPairs:
    """The distinct (hidden token, target) pairs the rows score.

    Attributes:
        hidden_token: (P,) int64 index into the trie tokens of the token whose hidden state predicts.
        target: (P,) int64 predicted token id.
        of_scored: (num_scored,) int32, the pair of each scored position, in the row-major order of the plan's
            score mask.
    """

    hidden_token: torch.Tensor
    target: torch.Tensor
    of_scored: torch.Tensor


def scored_pairs(trie: PrefixTrie, row: torch.Tensor, position: torch.Tensor, target: torch.Tensor) -> ScoredPairs:
    """The pairs of scored positions given as (row, position in the row's real tokens, target id), each (n,) int64
    in the score mask's row-major order; position 0 is never scored (nothing precedes a row's first token)."""
    _, hidden = trie.token_at(row, position - 1)
    key = hidden * (int(target.max()) + 1 if target.numel() else 1) + target
    unique, inverse = torch.unique(key, return_inverse=True)
    first = torch.full((unique.numel(),), -1, dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(key.numel()), reduce="amin", include_self=False
    )
    return ScoredPairs(hidden_token=hidden[first], target=target[first], of_scored=inverse.int())


#: The fields of a :class:`~..forward.node_call.NodeCall` that only some layouts read, built where the layout's
#: ``CALL_FIELDS`` name them (``backends/layouts.py``).
_OPTIONAL_FIELDS = ("pack_index", "pack_valid", "ancestor_index", "ancestor_valid", "levels")


def _pack_index(lengths: torch.Tensor) -> torch.Tensor:
    """(S, longest) int64: the packed token of each node's i-th token (0 past its end)."""
    valid = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    index = torch.zeros(valid.shape, dtype=torch.long)
    index[valid] = torch.arange(int(lengths.sum()))
    return index


class CallPlanner:
    """Plans the node calls of one trie one after another, remembering which call holds each node (all bookkeeping is
    per node and per pair: nothing per trie token or per row is kept)."""

    def __init__(self, trie: PrefixTrie, pairs: ScoredPairs, layout: str = "expand"):
        self.trie, self.pairs, self.layout = trie, pairs, layout
        # The optional fields of a call that the layout reads (``CALL_FIELDS`` of its module): only these are built.
        self.reads = tuple(layout_module(layout).CALL_FIELDS)
        # Whether a call may hold a node and its ancestors (several depths), each seeing the others in the call.
        self.multi_depth = layouts.layout(layout).multi_depth
        unknown = [name for name in self.reads if name not in _OPTIONAL_FIELDS]
        if unknown:
            raise ValueError(f"layout {layout!r} reads node-call fields the planner does not build: {unknown}")
        self.node_call = torch.full((trie.num_nodes,), -1, dtype=torch.long)
        self.node_local = torch.full((trie.num_nodes,), -1, dtype=torch.long)  # its first token's index in its call
        self.node_slot = torch.full((trie.num_nodes,), -1, dtype=torch.long)  # its index among its call's nodes
        self.call_nodes: list[torch.Tensor] = []
        self.call_sizes: list[int] = []
        # Pairs sorted by the node of their hidden token, so a call finds its pairs by ranges.
        self.pair_node = torch.searchsorted(trie.node_offset, pairs.hidden_token, right=True) - 1
        self.pair_order = torch.argsort(self.pair_node, stable=True).int()
        counts = torch.bincount(self.pair_node, minlength=trie.num_nodes)
        self.pair_start, self.pair_count = torch.cumsum(counts, 0) - counts, counts

    @property
    def num_calls(self) -> int:
        return len(self.call_nodes)

    def _runs(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token of ``nodes`` (back to back): its node and its index inside that node."""
        lengths = self.trie.node_length[nodes]
        node = torch.repeat_interleave(nodes, lengths)
        order = torch.arange(node.numel()) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
        return node, order

    def plan(self, nodes) -> NodeCall:
        """The next call, over ``nodes`` (ascending, i.e. depth-first; each ancestor planned in an earlier call, or in
        this one where the layout serves calls of several depths)."""
        trie = self.trie
        nodes = torch.as_tensor(nodes, dtype=torch.long)
        call_id = self.num_calls
        lengths = trie.node_length[nodes]
        count = int(lengths.sum())
        query_node, query_order = self._runs(nodes)
        self.node_call[nodes] = call_id
        self.node_local[nodes] = torch.cumsum(lengths, 0) - lengths
        self.node_slot[nodes] = torch.arange(nodes.numel())
        self.call_nodes.append(nodes)
        self.call_sizes.append(count)

        # Each node's ancestor tokens are those of any row through it at positions 0 .. node start - 1.
        starts = trie.node_start[nodes]
        columns = torch.arange(int(starts.max()))
        ancestor_valid = columns[None, :] < starts[:, None]
        ancestor, token = trie.token_at(trie.node_row[nodes][:, None], columns[None, :])
        ancestor = ancestor.masked_fill(~ancestor_valid, 0)
        ancestor_call = self.node_call[ancestor]
        in_call = ancestor_valid & (ancestor_call == call_id)
        if not self.multi_depth and bool(in_call.any()):
            raise RuntimeError(
                f"a node call holds a node and one of its ancestors, which layout {self.layout!r} "
                "does not serve (a call per depth)"
            )
        sources = torch.unique(ancestor_call[ancestor_valid & ~in_call]).tolist()
        if any(source < 0 for source in sources):
            raise RuntimeError("a node call was planned before one of its ancestors' calls")

        def store_index():  # the layouts of one depth per call only: every ancestor token in the store
            source_offset = torch.zeros(max(call_id, 1), dtype=torch.long)
            sizes = torch.tensor([self.call_sizes[s] for s in sources], dtype=torch.long)
            source_offset[sources] = torch.cumsum(sizes, 0) - sizes
            within = token - trie.node_offset[ancestor]
            return (source_offset[ancestor_call] + self.node_local[ancestor] + within).masked_fill(~ancestor_valid, 0)

        span = torch.repeat_interleave(torch.arange(nodes.numel()), self.pair_count[nodes])
        within_pairs = (
            torch.arange(span.numel()) - (torch.cumsum(self.pair_count[nodes], 0) - self.pair_count[nodes])[span]
        )
        head_pairs = self.pair_order[self.pair_start[nodes][span] + within_pairs].long()
        pair_node = self.pair_node[head_pairs]
        head_index = self.node_local[pair_node] + self.pairs.hidden_token[head_pairs] - trie.node_offset[pair_node]
        store_nodes = torch.cat([self.call_nodes[s] for s in sources]) if sources else nodes[:0]
        store_node, store_order = self._runs(store_nodes)
        optional = {
            "pack_index": lambda: _pack_index(lengths),
            "pack_valid": lambda: torch.arange(int(lengths.max()))[None, :] < lengths[:, None],
            "ancestor_index": store_index,
            "ancestor_valid": lambda: ancestor_valid,
            "levels": lambda: self._levels(nodes, lengths, store_index()),
        }
        extra = {name: optional[name]() for name in self.reads}
        # Later calls attend over this one's prefix states where some node has a descendant outside the call.
        outside = torch.ones(trie.num_nodes + 1, dtype=torch.long)
        outside[nodes + 1] = 0
        outside = torch.cumsum(outside, 0)  # outside[k]: nodes before k (and the sentinel) not in this call, plus 1
        ends = trie.subtree_end[nodes]
        keeps_states = bool((outside[ends] - outside[nodes + 1] > 0).any())
        return NodeCall(
            nodes=nodes,
            input_ids=trie.tokens[trie.node_offset[query_node] + query_order][None],
            positions=(trie.node_start[query_node] + query_order)[None],
            sources=sources,
            head_index=head_index,
            head_pairs=head_pairs,
            head_targets=self.pairs.target[head_pairs],
            query_node=query_node,
            query_order=query_order,
            query_slot=torch.repeat_interleave(torch.arange(nodes.numel()), lengths),
            store_node=store_node,
            store_order=store_order,
            store_positions=trie.node_start[store_node] + store_order,
            node_end=trie.subtree_end,
            keeps_states=keeps_states,
            same_ancestors=bool(starts.min() == starts.max()),
            **extra,
        )

    def _levels(self, nodes, lengths, store_index) -> tuple[FlashLevel, ...]:
        """Per ancestor level, the runs of the call's nodes (depth-first, so a level's ancestors come in runs) that
        share their ancestor there, and the store tokens of each run's ancestor."""
        trie = self.trie
        depth = int(trie.depth[nodes[0]])
        path = trie.row_path[trie.node_row[nodes]]
        levels = []
        for level in range(depth - 1):
            ancestor = path[:, level]
            first = torch.ones_like(ancestor, dtype=torch.bool)
            first[1:] = ancestor[1:] != ancestor[:-1]
            run = torch.cumsum(first.long(), 0) - 1
            leaders = first.nonzero().squeeze(1)
            start = trie.node_start[ancestor[leaders]]
            key_counts = trie.node_length[ancestor[leaders]]
            offsets = torch.repeat_interleave(torch.cumsum(key_counts, 0) - key_counts, key_counts)
            columns = torch.repeat_interleave(start, key_counts) + torch.arange(int(key_counts.sum())) - offsets
            key_tokens = store_index[torch.repeat_interleave(leaders, key_counts), columns]
            query_counts = torch.zeros(leaders.numel(), dtype=torch.long).index_add_(0, run, lengths)
            levels.append(FlashLevel(query_counts, key_tokens, key_counts))
        return tuple(levels)
