"""The token trie: nodes are maximal runs shared by the same rows, numbered depth-first, paths rebuild each row."""

import pytest
import torch
from support.trees import random_tree_rows

from shared_prefix_logps.tree.trie import build_trie


def _justify(rows):
    width = max((len(r) for r in rows), default=0)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return ids, torch.tensor([len(r) for r in rows], dtype=torch.long)


def _node_tokens(trie, node):
    offset, length = int(trie.node_offset[node]), int(trie.node_length[node])
    return trie.tokens[offset : offset + length].tolist()


def _check_invariants(trie, rows):
    num = trie.num_nodes
    children = [[] for _ in range(num)]
    for node in range(num):
        parent = int(trie.parent[node])
        assert trie.node_length[node] >= 1
        if parent >= 0:
            assert parent < node  # depth-first pre-order: ancestors first
            children[parent].append(node)
            assert trie.depth[node] == trie.depth[parent] + 1
            assert trie.node_start[node] == trie.node_start[parent] + trie.node_length[parent]
        else:
            assert trie.depth[node] == 1 and trie.node_start[node] == 0
    # Subtrees are contiguous ranges: [node, subtree_end) holds exactly the node and its descendants.
    for node in range(num):
        inside = set(range(node, int(trie.subtree_end[node])))
        descendants = {d for d in range(num) if node in trie.ancestors(d) or d == node}
        assert inside == descendants
    ends = {int(e) for e in trie.row_end if e >= 0}
    for node in range(num):
        firsts = [_node_tokens(trie, c)[0] for c in children[node]]
        assert len(firsts) == len(set(firsts)), "siblings must start with different tokens"
        # Maximal: a node that no row ends at and that has one child would merge with it.
        assert node in ends or len(children[node]) != 1
    # Each row is its path's tokens; row_tokens index those tokens.
    for i, row in enumerate(rows):
        path_tokens = [t for node in trie.path(i) for t in _node_tokens(trie, node)]
        assert path_tokens == row
        assert trie.tokens[trie.row_tokens[i, : len(row)]].tolist() == row
    # Each trie token is one distinct prefix of the rows: nothing is stored twice, nothing is missing.
    prefixes = {tuple(row[: j + 1]) for row in rows for j in range(len(row))}
    assert trie.num_tokens == len(prefixes)


def test_hand_built_example():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5], [1, 2], [1, 2, 3, 4], [7], []]
    trie = build_trie(*_justify(rows))
    # [1 2] -> [3] -> {[4], [5]}, and [7]; row 2 ends at [1 2]; rows 0 and 3 share every node; row 5 is empty.
    assert [_node_tokens(trie, n) for n in range(trie.num_nodes)] == [[1, 2], [3], [4], [5], [7]]
    assert trie.parent.tolist() == [-1, 0, 1, 1, -1]
    assert trie.node_start.tolist() == [0, 2, 3, 3, 0]
    assert trie.subtree_end.tolist() == [4, 4, 3, 4, 5]
    assert trie.row_end.tolist() == [2, 3, 0, 2, 4, -1]
    assert trie.path(1) == [0, 1, 3]
    _check_invariants(trie, rows)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("depth,branching", [(1, 8), (2, 8), (3, 3), (5, 2)])
def test_random_tries(seed, depth, branching):
    rows = random_tree_rows(seed, depth=depth, branching=branching)
    trie = build_trie(*_justify(rows))
    _check_invariants(trie, rows)
    assert trie.num_tokens < sum(len(r) for r in rows)  # the shared system prompt is stored once


def test_rows_that_share_nothing_form_a_forest():
    rows = [[5, 6], [8, 9, 10], [5, 6, 7]]
    trie = build_trie(*_justify(rows))
    assert (trie.parent < 0).sum() == 2
    _check_invariants(trie, rows)
