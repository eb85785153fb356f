"""The token trie of a call's rows: every prefix the rows share, at any depth, as one node.

A node is a run of tokens shared by the same set of rows. Each row is a path from a top-level node down to the node
where it ends. Rows may begin with different tokens, so the trie is a forest: top-level nodes have no parent.

Two builders: :func:`build_trie` searches the rows for their longest common prefixes (a radix trie: a row that is a
prefix of another ends at a node boundary, duplicate rows share their whole path); :func:`grouped_trie` builds the
two-level trie of a :class:`~shared_prefix_logps.inputs.GroupedBatch` directly, without a search: one node per
prompt, one child per completion with a token (siblings that start alike are not merged).

Nodes are numbered depth-first (pre-order), so a node's subtree is the contiguous range ``[node, subtree_end[node])``
and every ancestor comes before its descendants. The tokens of all nodes, laid out node after node in that order,
are the *trie tokens*.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefixTrie:
    """Nodes of a token trie and each row's path through them (all int64, on the CPU).

    Attributes:
        tokens: (num_tokens,) the trie tokens: node 0's tokens, then node 1's, ... (depth-first order).
        node_offset: (num_nodes,) index of each node's first token in ``tokens``.
        node_length: (num_nodes,) tokens per node (at least 1).
        node_start: (num_nodes,) position of each node's first token in its rows (tokens on the path above).
        parent: (num_nodes,) the parent node, -1 for top-level nodes.
        depth: (num_nodes,) 1 for top-level nodes, parent's depth + 1 below.
        subtree_end: (num_nodes,) one past the last node of each node's subtree (depth-first numbering).
        node_row: (num_nodes,) a row whose path passes through each node.
        row_end: (rows,) the node where each row ends, -1 for a row without real tokens.
        row_path: (rows, deepest) the nodes of each row's path, top-level first, -1 past its end.
        row_length: (rows,) real tokens per row.
    """

    tokens: torch.Tensor
    node_offset: torch.Tensor
    node_length: torch.Tensor
    node_start: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    subtree_end: torch.Tensor
    node_row: torch.Tensor
    row_end: torch.Tensor
    row_path: torch.Tensor
    row_length: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return int(self.node_offset.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    def path(self, row: int) -> list[int]:
        """The nodes of ``row`` from its top-level node down to the node where it ends (empty for an empty row)."""
        path = self.row_path[row]
        return path[path >= 0].tolist()

    def ancestors(self, node: int) -> list[int]:
        """The strict ancestors of ``node``, top-level first."""
        path = self.row_path[int(self.node_row[node])]
        return path[: int(self.depth[node]) - 1].tolist()

    def token_at(self, rows: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The node holding each row's token at each position, and that token's index in ``tokens``; both -1 past a
        row's end. ``rows``/``positions``: int64 of one shape (broadcast), the position among the row's real tokens.
        One pass per depth of the trie, nothing kept per row and position."""
        rows, positions = torch.broadcast_tensors(rows, positions)
        node = torch.full(rows.shape, -1, dtype=torch.long)
        for level in range(self.row_path.shape[1]):
            at = self.row_path[rows, level]
            safe = at.clamp(min=0)
            start = self.node_start[safe]
            inside = (at >= 0) & (positions >= start) & (positions < start + self.node_length[safe])
            node = torch.where(inside, at, node)
        safe = node.clamp(min=0)
        index = self.node_offset[safe] + positions - self.node_start[safe]
        return node, torch.where(node >= 0, index, -1)

    def row_token_indices(self, row: int) -> torch.Tensor:
        """(row length,) int64: the index in ``tokens`` of each of ``row``'s real tokens."""
        length = int(self.row_length[row])
        return self.token_at(torch.full((length,), row, dtype=torch.long), torch.arange(length))[1]


def build_trie(rows: torch.Tensor, lengths: torch.Tensor) -> PrefixTrie:
    """The radix trie of ``rows``.

    Args:
        rows: (N, W) int64, row i's real tokens in ``rows[i, :lengths[i]]`` (left-justified, any padding after).
        lengths: (N,) int64 real tokens per row (0 allowed).

    Work is vectorized per node: the common prefix of a node's rows is found with one tensor comparison.
    """
    rows = rows.detach().to("cpu", torch.long)
    lengths = lengths.detach().to("cpu", torch.long)
    num_rows = rows.shape[0]
    starts, parents, row_end, token_runs = [], [], [-1] * num_rows, []
    # Depth-first, pre-order: a stack of (rows of the node to build, its start position, parent). Children are pushed
    # in reverse token order so they are numbered in ascending first-token order.
    stack = _children(rows, torch.arange(num_rows)[lengths > 0], 0, -1)[::-1]
    while stack:
        members, start, parent = stack.pop()
        end = _common_end(rows, lengths, members, start)
        node = len(token_runs)
        starts.append(start)
        parents.append(parent)
        token_runs.append(rows[members[0], start:end])
        ending = lengths[members] == end
        for row in members[ending].tolist():
            row_end[row] = node
        stack.extend(_children(rows, members[~ending], end, node)[::-1])
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
    node_length = torch.tensor([int(run.numel()) for run in token_runs], dtype=torch.long)
    tokens = torch.cat(token_runs) if token_runs else torch.zeros(0, dtype=torch.long)
    return _derived(
        tokens,
        node_length,
        torch.tensor(starts, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        row_end=torch.tensor(row_end, dtype=torch.long),
        row_length=lengths.to("cpu", torch.long),
    )


def grouped_trie(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    group_index: torch.Tensor,
) -> PrefixTrie:
    """The two-level trie of a grouped batch, built without a search: a node per prompt, below it a node per
    completion row with a valid token (a row without one ends at its prompt's node), rows in their order within a
    prompt. Prompts are left-padded (num_prompts, P), completions right-padded (rows, C); ``group_index`` (rows,)
    gives each row's prompt. Row ``r`` of the trie is completion row ``r``: its path is ``[prompt, completion]``."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, group_index = (
        t.detach().to("cpu") for t in (prompt_ids, prompt_mask, completion_ids, completion_mask, group_index)
    )
    num_prompts, width = prompt_ids.shape
    prompt_len = prompt_mask.sum(1)
    completion_len = completion_mask.sum(1)
    has_child = completion_len > 0
    # Rows by prompt (stable: in their order within a prompt); the children of a prompt follow it.
    order = torch.argsort(group_index, stable=True)
    children = torch.bincount(group_index[has_child], minlength=num_prompts)
    prompt_node = torch.arange(num_prompts) + torch.cumsum(children, 0) - children
    child_rows = order[has_child[order]]
    child_group = group_index[child_rows]
    rank = torch.arange(child_rows.numel()) - (torch.cumsum(children, 0) - children)[child_group]
    child_node = prompt_node[child_group] + 1 + rank
    num_nodes = num_prompts + child_rows.numel()
    node_length = torch.zeros(num_nodes, dtype=torch.long)
    node_start = torch.zeros(num_nodes, dtype=torch.long)
    parent = torch.full((num_nodes,), -1, dtype=torch.long)
    node_length[prompt_node] = prompt_len
    node_length[child_node] = completion_len[child_rows]
    node_start[child_node] = prompt_len[child_group]
    parent[child_node] = prompt_node[child_group]
    # Each node's tokens scattered to their place among the trie tokens (nodes back to back, depth-first).
    node_offset = torch.cumsum(node_length, 0) - node_length
    tokens = torch.zeros(int(node_length.sum()), dtype=torch.long)
    prompt, column = prompt_mask.nonzero(as_tuple=True)
    tokens[node_offset[prompt_node[prompt]] + column - (width - prompt_len[prompt])] = prompt_ids[prompt, column]
    child, column = completion_mask[child_rows].nonzero(as_tuple=True)
    tokens[node_offset[child_node[child]] + column] = completion_ids[child_rows[child], column]
    row_end = prompt_node[group_index].clone()
    row_end[child_rows] = child_node
    return _derived(
        tokens, node_length, node_start, parent, row_end=row_end, row_length=prompt_len[group_index] + completion_len
    )


def _derived(tokens, node_length, node_start, parent, *, row_end, row_length) -> PrefixTrie:
    """The trie with the fields that follow from its nodes (pre-order: ``tokens`` back to back, each node's length,
    start position and parent) and its rows (each one's end node and length), all vectorized."""
    num_nodes = node_length.numel()
    num_rows = row_end.numel()
    node_offset = torch.cumsum(node_length, 0) - node_length
    depth = torch.ones(num_nodes, dtype=torch.long)
    has_parent = parent >= 0
    while True:  # one pass per level: a node's depth is its parent's + 1
        updated = torch.where(has_parent, depth[parent.clamp(min=0)] + 1, depth)
        if torch.equal(updated, depth):
            break
        depth = updated
    deepest = int(depth.max()) if num_nodes else 0
    size = torch.ones(num_nodes, dtype=torch.long)
    for level in range(deepest, 1, -1):  # each level's subtree sizes, added to their parents
        at = (depth == level).nonzero().squeeze(1)
        size.index_add_(0, parent[at], size[at])
    subtree_end = torch.arange(num_nodes) + size
    row_path = torch.full((num_rows, deepest), -1, dtype=torch.long)
    node, rows = row_end.clone(), torch.arange(num_rows)
    for _ in range(deepest):
        alive = node >= 0
        row_path[rows[alive], depth[node[alive]] - 1] = node[alive]
        node = torch.where(alive, parent[node.clamp(min=0)], node)
    node_row = torch.zeros(num_nodes, dtype=torch.long)
    on_path = row_path >= 0
    node_row[row_path[on_path]] = rows[:, None].expand_as(row_path)[on_path]
    return PrefixTrie(
        tokens=tokens,
        node_offset=node_offset,
        node_length=node_length,
        node_start=node_start,
        parent=parent,
        depth=depth,
        subtree_end=subtree_end,
        node_row=node_row,
        row_end=row_end,
        row_path=row_path,
        row_length=row_length,
    )


def _children(rows, members: torch.Tensor, start: int, parent: int) -> list[tuple]:
    """One stack entry per distinct token at ``start`` among ``members`` (rows longer than ``start``), in ascending
    token order."""
    if members.numel() == 0:
        return []
    firsts = rows[members, start]
    return [(members[firsts == token], start, parent) for token in torch.unique(firsts).tolist()]


def _common_end(rows, lengths, members: torch.Tensor, start: int) -> int:
    """One past the last position from ``start`` on where every member row has a token and all agree."""
    shortest = int(lengths[members].min())
    block = rows[members, start:shortest]
    agree = (block == block[:1]).all(0)
    disagree = (~agree).nonzero()
    return start + int(disagree[0]) if disagree.numel() else shortest


def levels(trie: PrefixTrie) -> list[list[int]]:
    """The nodes of each depth, top level first, each in depth-first order."""
    depth = trie.depth.tolist()
    out: list[list[int]] = [[] for _ in range(max(depth, default=0))]
    for node, d in enumerate(depth):
        out[d - 1].append(node)
    return out
