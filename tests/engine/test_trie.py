"""The token trie: nodes are maximal runs shared by the same rows, numbered depth-first, paths rebuild each row."""

import pytest
import torch
from support.trees import random_tree_rows

from shared_prefix_logps.engine.trie import build_trie, grouped_trie


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
    # Each row is its path's tokens; token_at finds them.
    for i, row in enumerate(rows):
        path_tokens = [t for node in trie.path(i) for t in _node_tokens(trie, node)]
        assert path_tokens == row
        assert trie.tokens[trie.row_token_indices(i)].tolist() == row
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


def test_grouped_trie_has_a_node_per_prompt_and_one_per_completion():
    """A grouped batch's trie, built without a search: each prompt a top-level node (duplicates too), below it one node
    per completion with a token (siblings that start alike, and identical completions, are not merged); an empty
    completion's row ends at its prompt. Rows keep their order, whatever the order of their prompts."""
    prompts = [[4, 5, 6], [9], [4, 5, 6]]
    completions = [[1, 2], [], [1, 2], [7], [1], [3, 3, 3]]
    group_index = torch.tensor([2, 0, 0, 1, 2, 0])
    prompt_ids = torch.zeros(3, 3, dtype=torch.long)
    prompt_mask = torch.zeros(3, 3, dtype=torch.bool)
    for i, p in enumerate(prompts):
        prompt_ids[i, 3 - len(p) :] = torch.tensor(p)
        prompt_mask[i, 3 - len(p) :] = True
    completion_ids = torch.zeros(6, 3, dtype=torch.long)
    completion_mask = torch.zeros(6, 3, dtype=torch.bool)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        completion_mask[i, : len(c)] = True
    trie = grouped_trie(prompt_ids, prompt_mask, completion_ids, completion_mask, group_index)
    assert [_node_tokens(trie, n) for n in range(trie.num_nodes)] == [
        [4, 5, 6],
        [1, 2],
        [3, 3, 3],
        [9],
        [7],
        [4, 5, 6],
        [1, 2],
        [1],
    ]
    assert trie.parent.tolist() == [-1, 0, 0, -1, 3, -1, 5, 5]
    assert trie.depth.tolist() == [1, 2, 2, 1, 2, 1, 2, 2]
    assert trie.row_end.tolist() == [6, 0, 1, 4, 7, 2]
    assert trie.subtree_end.tolist() == [3, 2, 3, 5, 5, 8, 7, 8]
    for row, completion in enumerate(completions):
        expected = prompts[int(group_index[row])] + completion
        assert [t for node in trie.path(row) for t in _node_tokens(trie, node)] == expected
        assert trie.tokens[trie.row_token_indices(row)].tolist() == expected
        assert trie.token_at(torch.tensor(row), torch.tensor(len(expected)))[1] == -1
