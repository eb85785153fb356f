"""The token trie of a batch of rows: every prefix the rows share, at any depth, as one node.

A node is a maximal run of tokens shared by the same set of rows (a radix-trie edge). Each row is a path from a
top-level node down to the node where it ends; a row that is a prefix of another ends at a node boundary (the set of
rows changes there), and duplicate rows share their whole path. Rows may begin with different tokens, so the trie
is a forest: top-level nodes have no parent.

Nodes are numbered depth-first (pre-order), so a node's subtree is the contiguous range ``[node, subtree_end[node])``
and every ancestor comes before its descendants. The tokens of all nodes, laid out node after node in that order,
are the *trie tokens*: every token any row holds is one of them, and each shared token is there once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixTrie:
    """Nodes of a token trie and each row's path through them.

    Attributes:
        tokens: (num_tokens,) int64, the trie tokens: node 0's tokens, then node 1's, ... (depth-first order).
        node_offset: (num_nodes,) int64, index of each node's first token in ``tokens``.
        node_length: (num_nodes,) int64, tokens per node (at least 1).
        node_start: (num_nodes,) int64, position of each node's first token in its rows (tokens on the path above).
        parent: (num_nodes,) int64, the parent node, -1 for top-level nodes.
        depth: (num_nodes,) int64, 1 for top-level nodes, parent's depth + 1 below.
        subtree_end: (num_nodes,) int64, one past the last node of each node's subtree (depth-first numbering).
        row_end: (rows,) int64, the node where each row ends, -1 for a row without real tokens.
        row_tokens: (rows, longest row) int64, for each row's j-th real token its index in ``tokens`` (-1 past the
            row's end).
        row_length: (rows,) int64, real tokens per row.
    """

    tokens: torch.Tensor
    node_offset: torch.Tensor
    node_length: torch.Tensor
    node_start: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    subtree_end: torch.Tensor
    row_end: torch.Tensor
    row_tokens: torch.Tensor
    row_length: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.node_offset.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def path(self, row: int) -> list[int]:
        """The nodes of ``row`` from its top-level node down to the node where it ends (empty for an empty row)."""
        node = int(self.row_end[row])
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = int(self.parent[node])
        return nodes[::-1]

    def ancestors(self, node: int) -> list[int]:
        """The strict ancestors of ``node``, top-level first."""
        nodes = []
        node = int(self.parent[node])
        while node >= 0:
            nodes.append(node)
            node = int(self.parent[node])
        return nodes[::-1]

    def token_node(self) -> torch.Tensor:
        """(num_tokens,) int64, the node holding each trie token."""
        return torch.repeat_interleave(torch.arange(self.num_nodes), self.node_length)

    def token_position(self) -> torch.Tensor:
        """(num_tokens,) int64, each trie token's position in its rows."""
        node = self.token_node()
        return self.node_start[node] + torch.arange(self.num_tokens) - self.node_offset[node]


def build_trie(rows: torch.Tensor, lengths: torch.Tensor) -> PrefixTrie:
    """The trie of ``rows``.

    Args:
        rows: (N, W) int64, row i's real tokens in ``rows[i, :lengths[i]]`` (left-justified, any padding after).
        lengths: (N,) int64 real tokens per row (0 allowed).

    Work is vectorized per node: the common prefix of a node's rows is found with one tensor comparison.
    """
    rows = rows.detach().to("cpu", torch.long)
    lengths = lengths.detach().to("cpu", torch.long)
    num_rows = rows.shape[0]
    starts, parents, row_end, token_runs = [], [], [-1] * num_rows, []
    # Depth-first, pre-order: a stack of (rows of the node to build, its start position, parent, depth). Children
    # are pushed in reverse token order so they are numbered in ascending first-token order.
    stack = _children(rows, lengths, torch.arange(num_rows)[lengths > 0], 0, -1, 0)[::-1]
    while stack:
        members, start, parent, depth = stack.pop()
        end = _common_end(rows, lengths, members, start)
        node = len(token_runs)
        starts.append(start)
        parents.append(parent)
        token_runs.append(rows[members[0], start:end])
        ending = lengths[members] == end
        for row in members[ending].tolist():
            row_end[row] = node
        stack.extend(_children(rows, lengths, members[~ending], end, node, depth + 1)[::-1])
    return assemble_trie(token_runs, starts, parents, row_end, lengths)


def assemble_trie(
    token_runs: list[torch.Tensor], starts: list[int], parents: list[int], row_end: list[int], lengths: torch.Tensor
) -> PrefixTrie:
    """A :class:`PrefixTrie` from its nodes listed in depth-first pre-order.

    Args:
        token_runs: each node's tokens, (node length,) int64, at least one.
        starts: each node's position of its first token in its rows; parents: each node's parent (-1 at the top,
            always an earlier node).
        row_end: the node where each row ends (-1 for an empty row); lengths: (rows,) int64 real tokens per row,
            the length of the row's path.
    """
    num_rows = len(row_end)
    num_nodes = len(token_runs)
    node_lengths = [int(run.numel()) for run in token_runs]
    offsets = [0] * num_nodes
    depths = [1] * num_nodes
    for node in range(1, num_nodes):
        offsets[node] = offsets[node - 1] + node_lengths[node - 1]
    for node in range(num_nodes):
        if parents[node] >= 0:
            depths[node] = depths[parents[node]] + 1
    parent = torch.tensor(parents, dtype=torch.long)
    subtree_end = torch.arange(1, num_nodes + 1)
    for node in range(num_nodes - 1, -1, -1):  # children have larger numbers: fold ends upwards
        if parents[node] >= 0:
            subtree_end[parents[node]] = max(subtree_end[parents[node]], subtree_end[node])
    trie = PrefixTrie(
        tokens=torch.cat(token_runs) if token_runs else torch.zeros(0, dtype=torch.long),
        node_offset=torch.tensor(offsets, dtype=torch.long),
        node_length=torch.tensor(node_lengths, dtype=torch.long),
        node_start=torch.tensor(starts, dtype=torch.long),
        parent=parent,
        depth=torch.tensor(depths, dtype=torch.long),
        subtree_end=subtree_end,
        row_end=torch.tensor(row_end, dtype=torch.long),
        row_tokens=torch.full((num_rows, int(lengths.max()) if num_rows else 0), -1, dtype=torch.long),
        row_length=lengths,
    )
    for row in range(num_rows):
        indices = [torch.arange(o, o + n) for o, n in _path_runs(trie, row)]
        if indices:
            trie.row_tokens[row, : int(lengths[row])] = torch.cat(indices)
    return trie


def _path_runs(trie: PrefixTrie, row: int) -> list[tuple[int, int]]:
    return [(int(trie.node_offset[n]), int(trie.node_length[n])) for n in trie.path(row)]


def _children(rows, lengths, members: torch.Tensor, start: int, parent: int, depth: int) -> list[tuple]:
    """One stack entry per distinct token at ``start`` among ``members`` (rows longer than ``start``), in ascending
    token order."""
    if members.numel() == 0:
        return []
    firsts = rows[members, start]
    return [(members[firsts == token], start, parent, depth) for token in torch.unique(firsts).tolist()]


def _common_end(rows, lengths, members: torch.Tensor, start: int) -> int:
    """One past the last position from ``start`` on where every member row has a token and all agree."""
    shortest = int(lengths[members].min())
    block = rows[members, start:shortest]
    agree = (block == block[:1]).all(0)
    disagree = (~agree).nonzero()
    return start + int(disagree[0]) if disagree.numel() else shortest
