"""What each forward of a prefix-tree pass holds: scored pairs, and per forward ("node call") its packed tokens,
positions and the ancestor keys each node attends over.

A *scored pair* is (trie token whose last-layer hidden state predicts, target token). Every scored position of every
row maps to one: position ``j`` of a row is predicted by the row's token ``j - 1``. Inside a node the next token is
unique; the last token of a node predicts the first token of each child. Rows sharing a path share their pairs,
so each pair goes through the fused head once, whatever the number of rows that score it.

A *node call* is one forward of the model over a set of nodes none of which is an ancestor of another, each of whose
ancestors went through an earlier call. Its input is the nodes' tokens packed back to back (no padding forwarded);
inside attention each node becomes one row of a padded batch attending over its ancestors' keys/values (gathered
from the earlier calls that hold them) and causally over its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .inputs import TreeRows
from .trie import PrefixTrie


@dataclass(frozen=True)
class ScoredPairs:
    """The distinct (hidden token, target) pairs the rows score.

    Attributes:
        hidden_token: (P,) int64 index into the trie tokens of the token whose hidden state predicts.
        target: (P,) int64 predicted token id.
        of_scored: (num_scored,) int64, the pair of each True entry of ``score_mask`` in row-major order.
    """

    hidden_token: torch.Tensor
    target: torch.Tensor
    of_scored: torch.Tensor


def scored_pairs(trie: PrefixTrie, rows: TreeRows) -> ScoredPairs:
    """The pairs of every scored position of ``rows`` (whose trie is ``trie``)."""
    scored = rows.score_mask.cpu()
    row, column = scored.nonzero(as_tuple=True)
    j = column - rows.first_column.cpu()[row]
    hidden = trie.row_tokens[row, j - 1]
    target = rows.input_ids.cpu()[row, column]
    key = hidden * (int(target.max()) + 1 if target.numel() else 1) + target
    unique, inverse = torch.unique(key, return_inverse=True)
    first = torch.full((unique.numel(),), -1, dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(key.numel()), reduce="amin", include_self=False
    )
    return ScoredPairs(hidden_token=hidden[first], target=target[first], of_scored=inverse)


@dataclass(frozen=True)
class NodeCall:
    """One forward over ``nodes``; (S = len(nodes), Lmax = longest node, T = their tokens, A = most ancestor
    tokens of a node).

    Attributes:
        nodes: the trie nodes, in depth-first order.
        input_ids: (1, T) int64 packed tokens; positions: (1, T) int64 their positions in the rows.
        pack_index: (S, Lmax) int64, index into the T packed tokens of each node's i-th token (0 past its end).
        pack_valid: (S, Lmax) bool, True on real node tokens.
        own_positions: (S, Lmax) int64 position of each node token (0 past its end).
        sources: earlier calls whose keys/values hold the ancestors, in the order their tokens are concatenated
            into the ancestor store.
        ancestor_index: (S, A) int64, index into the ancestor store of each ancestor token (0 past the end).
        ancestor_valid: (S, A) bool; ancestor_positions: (S, A) int64.
        head_index: (p,) int64, the packed token of each pair this call scores; head_pairs: (p,) their pair ids;
            head_targets: (p,) their target ids.
        query_node / query_order: (T,) int64, each packed token's node and its index inside that node.
        store_node / store_order / store_positions: (A_total,) int64, the same and the position of every token of
            the ancestor store (all tokens of ``sources``, ancestors of this call's nodes or not): the packed
            ``flex`` layout attends over the whole store under a mask built from the trie's structure.
        node_end: (num_nodes,) int64, the trie's ``subtree_end``: node k is an ancestor of (or is) node q exactly
            when ``k <= q < node_end[k]``.
    """

    nodes: list[int]
    input_ids: torch.Tensor
    positions: torch.Tensor
    pack_index: torch.Tensor
    pack_valid: torch.Tensor
    own_positions: torch.Tensor
    sources: list[int]
    ancestor_index: torch.Tensor
    ancestor_valid: torch.Tensor
    ancestor_positions: torch.Tensor
    head_index: torch.Tensor
    head_pairs: torch.Tensor
    head_targets: torch.Tensor
    query_node: torch.Tensor
    query_order: torch.Tensor
    store_node: torch.Tensor
    store_order: torch.Tensor
    store_positions: torch.Tensor
    node_end: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device) -> NodeCall:
        """The call with its tensors on ``device``: one host-to-device copy for all of them (see
        :func:`to_device`)."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__}
        tensors = {k: v for k, v in fields.items() if isinstance(v, torch.Tensor)}
        return NodeCall(**{**fields, **to_device(tensors, torch.device(device))})


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """``tensors`` (int64 or bool, planned on the host) on ``device``, through one host-to-device copy.

    Copied one by one, a node call's 17 index tensors were 17 copies from pageable memory, each of which the host
    waits for. They are packed into one int64 buffer (page-locked when the target is CUDA, so the copy runs
    asynchronously), copied once and cut apart on the device (bool fields come back as bool). Tensors already on
    ``device`` are returned as they are; tensors on other devices than the host are copied one by one.
    """
    moving = {k: v for k, v in tensors.items() if v.device != device}
    if not moving:
        return dict(tensors)
    if any(v.device.type != "cpu" for v in moving.values()):
        return {k: v.to(device) for k, v in tensors.items()}
    buffer, layout = pack(moving, pin=device.type == "cuda")
    return {**tensors, **unpack(buffer.to(device, non_blocking=True), layout)}


def pack(tensors: dict[str, torch.Tensor], *, pin: bool = False) -> tuple[torch.Tensor, list]:
    """Host ``tensors`` (int64 or bool) flattened into one int64 buffer (page-locked with ``pin``), and the layout
    :func:`unpack` cuts it apart by: (name, shape, dtype) per tensor, in order."""
    flat = [v.reshape(-1).long() for v in tensors.values()]
    buffer = torch.empty(sum(t.numel() for t in flat), dtype=torch.long, pin_memory=pin)
    torch.cat(flat, out=buffer)
    return buffer, [(name, value.shape, value.dtype) for name, value in tensors.items()]


def unpack(buffer: torch.Tensor, layout: list) -> dict[str, torch.Tensor]:
    """The tensors :func:`pack` packed into ``buffer`` (on any device): views of it, bool fields as bool."""
    out, start = {}, 0
    for name, shape, dtype in layout:
        count = shape.numel()
        part = buffer[start : start + count].view(shape)
        out[name] = part.bool() if dtype == torch.bool else part.to(dtype)
        start += count
    return out


class CallPlanner:
    """Plans node calls one after another, remembering which call holds each trie token."""

    def __init__(self, trie: PrefixTrie, pairs: ScoredPairs):
        self.trie = trie
        self.pairs = pairs
        self.token_call = torch.full((trie.num_tokens,), -1, dtype=torch.long)
        self.token_local = torch.full((trie.num_tokens,), -1, dtype=torch.long)
        self.call_sizes: list[int] = []
        self.call_tokens: list[torch.Tensor] = []
        self.token_node = trie.token_node()
        self.positions = trie.token_position()
        # Pairs grouped by the node of their hidden token.
        self.pair_node = self.token_node[pairs.hidden_token]

    def plan(self, nodes: list[int]) -> NodeCall:
        """The next call, over ``nodes`` (each ancestor already planned; no node an ancestor of another)."""
        trie = self.trie
        call_id = len(self.call_sizes)
        offsets = trie.node_offset[nodes]
        lengths = trie.node_length[nodes]
        width = int(lengths.max())
        inner = torch.arange(width)
        pack_valid = inner[None, :] < lengths[:, None]
        global_tokens = (offsets[:, None] + inner[None, :])[pack_valid]
        total = int(global_tokens.numel())
        pack_index = torch.zeros(len(nodes), width, dtype=torch.long)
        pack_index[pack_valid] = torch.arange(total)
        own_positions = (trie.node_start[nodes][:, None] + inner[None, :]).masked_fill(~pack_valid, 0)
        self.token_call[global_tokens] = call_id
        self.token_local[global_tokens] = torch.arange(total)
        self.call_sizes.append(total)
        self.call_tokens.append(global_tokens)

        ancestor_tokens = [self._ancestor_tokens(node) for node in nodes]
        calls = torch.cat(ancestor_tokens) if ancestor_tokens else torch.zeros(0, dtype=torch.long)
        sources = sorted(set(self.token_call[calls].tolist()))
        if any(source < 0 or source == call_id for source in sources):
            raise RuntimeError("a node call was planned before one of its ancestors' calls")
        source_offset = torch.zeros(max(call_id, 1), dtype=torch.long)
        running = 0
        for source in sources:
            source_offset[source] = running
            running += self.call_sizes[source]
        longest = max((t.numel() for t in ancestor_tokens), default=0)
        ancestor_index = torch.zeros(len(nodes), longest, dtype=torch.long)
        ancestor_valid = torch.zeros(len(nodes), longest, dtype=torch.bool)
        ancestor_positions = torch.zeros(len(nodes), longest, dtype=torch.long)
        for i, tokens in enumerate(ancestor_tokens):
            count = tokens.numel()
            ancestor_index[i, :count] = source_offset[self.token_call[tokens]] + self.token_local[tokens]
            ancestor_valid[i, :count] = True
            ancestor_positions[i, :count] = self.positions[tokens]

        empty = torch.zeros(0, dtype=torch.long)
        store_tokens = torch.cat([self.call_tokens[source] for source in sources]) if sources else empty
        store_node = self.token_node[store_tokens]
        query_node = self.token_node[global_tokens]
        in_call = torch.isin(self.pair_node, torch.tensor(nodes, dtype=torch.long))
        head_pairs = in_call.nonzero().squeeze(1)
        return NodeCall(
            nodes=list(nodes),
            input_ids=trie.tokens[global_tokens][None],
            positions=self.positions[global_tokens][None],
            pack_index=pack_index,
            pack_valid=pack_valid,
            own_positions=own_positions,
            sources=sources,
            ancestor_index=ancestor_index,
            ancestor_valid=ancestor_valid,
            ancestor_positions=ancestor_positions,
            head_index=self.token_local[self.pairs.hidden_token[head_pairs]],
            head_pairs=head_pairs,
            head_targets=self.pairs.target[head_pairs],
            query_node=query_node,
            query_order=global_tokens - trie.node_offset[query_node],
            store_node=store_node,
            store_order=store_tokens - trie.node_offset[store_node],
            store_positions=self.positions[store_tokens],
            node_end=trie.subtree_end,
        )

    def _ancestor_tokens(self, node: int) -> torch.Tensor:
        runs = [
            torch.arange(int(self.trie.node_offset[a]), int(self.trie.node_offset[a] + self.trie.node_length[a]))
            for a in self.trie.ancestors(node)
        ]
        return torch.cat(runs) if runs else torch.zeros(0, dtype=torch.long)


def levels(trie: PrefixTrie) -> list[list[int]]:
    """The nodes of each depth, top level first, each in depth-first order."""
    depth = trie.depth.tolist()
    out: list[list[int]] = [[] for _ in range(max(depth, default=0))]
    for node, d in enumerate(depth):
        out[d - 1].append(node)
    return out
