"""The tiny-node rule: which nodes it merges on a hand-built trie, what the merged trie holds, and that both tree
entry points stay exact against the dense rows with and without merging."""

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import build_model
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import chunked_backward_tree, compute_logps_tree
from shared_prefix_logps.bench.node_cost import fork_rows
from shared_prefix_logps.engine.merge import (
    MERGE_BELOW_SAVED_TOKENS,
    merge_decisions,
    merge_tiny_nodes,
    split_one_token_forks,
)
from shared_prefix_logps.engine.trie import build_trie

PROMPT = list(range(1, 9))  # 8 tokens
HAND_ROWS = [
    PROMPT + [50, 60, 61],  # [50]: one token above two leaves, saves 1
    PROMPT + [50, 62, 63],
    PROMPT + [51, 52, 53],
    [9, 70, 71],  # [9]: a one-token common start of two rows, saves 1
    [9, 72, 73],
    [20, 21, 30, 40],  # [30] saves 1; [20 21] then reaches 3 nodes: saves 2 * 2 = 4
    [20, 21, 30, 41],
    [20, 21, 31],
    [25],  # a row ends at [25]: it keeps a node of its own, whatever it saves
    [25, 26],
    [25, 27],
]


def _justify(rows):
    lengths = torch.tensor([len(r) for r in rows])
    ids = torch.zeros(len(rows), int(lengths.max()), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
    return ids, lengths


def _node_tokens(trie):
    return [trie.tokens[o : o + n].tolist() for o, n in zip(trie.node_offset.tolist(), trie.node_length.tolist())]


def _check_merged(merged, rows):
    """Every row is its path's tokens at their positions; depth, start and subtree ranges follow the parents."""
    for node in range(merged.num_nodes):
        parent = int(merged.parent[node])
        if parent >= 0:
            assert parent < node and merged.depth[node] == merged.depth[parent] + 1
            assert merged.node_start[node] == merged.node_start[parent] + merged.node_length[parent]
        else:
            assert merged.depth[node] == 1 and merged.node_start[node] == 0
        inside = set(range(node, int(merged.subtree_end[node])))
        assert inside == {d for d in range(merged.num_nodes) if d == node or node in merged.ancestors(d)}
    tokens = _node_tokens(merged)
    for i, row in enumerate(rows):
        assert [t for n in merged.path(i) for t in tokens[n]] == row
        assert merged.tokens[merged.row_token_indices(i)].tolist() == row


def test_hand_built_trie_merges_exactly_the_tiny_nodes():
    trie = build_trie(*_justify(HAND_ROWS))
    tokens = _node_tokens(trie)
    merged_nodes = [tokens[n] for n in merge_decisions(trie, 4).nonzero().squeeze(1).tolist()]
    assert merged_nodes == [[50], [9], [30]]  # [20 21] saves 4, not fewer than 4; [25] holds a row's end
    merged = merge_tiny_nodes(trie, 4)
    assert _node_tokens(merged) == [
        PROMPT,
        [50, 60, 61],
        [50, 62, 63],
        [51, 52, 53],
        [9, 70, 71],
        [9, 72, 73],
        [20, 21],
        [30, 40],
        [30, 41],
        [31],
        [25],
        [26],
        [27],
    ]
    assert merged.parent.tolist() == [-1, 0, 0, 0, -1, -1, -1, 6, 6, 6, -1, 10, 10]
    assert merged.num_tokens == trie.num_tokens + 1 + 1 + 1  # each merged token forwarded once more
    _check_merged(merged, HAND_ROWS)

    # One token more of threshold: [20 21] goes too, into the three nodes below it, after [30] (bottom-up).
    merged = merge_tiny_nodes(trie, 5)
    assert [t for t in _node_tokens(merged) if t[0] == 20] == [[20, 21, 30, 40], [20, 21, 30, 41], [20, 21, 31]]
    assert merged.num_tokens == trie.num_tokens + 3 + 2 * 2
    _check_merged(merged, HAND_ROWS)

    assert merge_tiny_nodes(trie, 0) is trie  # switched off: the trie as built
    assert merge_tiny_nodes(trie, 1) is trie  # every node saves at least 1 token


def test_random_tries_rebuild_every_row_and_forward_at_most_the_threshold_more_per_merge():
    for seed in range(6):
        rows = random_tree_rows(seed, depth=4, branching=3)
        trie = build_trie(*_justify(rows))
        decisions = merge_decisions(trie)
        merged = merge_tiny_nodes(trie)
        _check_merged(merged, rows)
        count = int(decisions.sum())
        assert merged.num_nodes == trie.num_nodes - count
        extra = merged.num_tokens - trie.num_tokens
        assert 0 <= extra < count * MERGE_BELOW_SAVED_TOKENS or count == extra == 0


def test_the_measurement_workload_merges_the_fork_node_only():
    """node_cost's workload: the fork node of m tokens is the only node merged at m * 3 + 1 (the threshold its merged
    timings use), and is kept at m * 3."""
    for m in (1, 8, 32):
        ids, mask, _ = fork_rows(m, prompt=64, leaf=32, leaves=4, vocab=100)
        trie = build_trie(ids, mask.sum(1))
        assert trie.num_nodes == 7 and int(trie.depth.max()) == 3
        fork = [n for n in range(7) if (trie.parent == n).sum() == 4]  # the node above the 4 leaves
        assert len(fork) == 1 and trie.node_length[fork[0]] == m
        assert merge_decisions(trie, 3 * m + 1).nonzero().squeeze(1).tolist() == fork
        assert not merge_decisions(trie, 3 * m)[fork[0]]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("merge", [True, False])
def test_compute_logps_tree_exact_with_and_without_merging(family, merge):
    model = build_model(family)
    rows = random_tree_rows(11, depth=4, branching=3)
    ids, mask, score = pad_rows(rows, 11)
    trie = build_trie(*_justify(rows))
    assert merge_decisions(trie).sum() >= 3  # the rule has nodes to merge here
    tree = compute_logps_tree(model, ids, mask, score, return_entropy=True, merge_tiny_nodes=merge)
    dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    assert (tree.logps[score] != 0).all()
    assert (tree.logps - dense.logps).abs().max().item() < 1e-5
    assert (tree.entropy - dense.entropy).abs().max().item() < 1e-5
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(tree)), parameter_grads(model, weighted_loss(dense))
    )
    assert grad_err < 1e-4, grad_err
    with torch.no_grad():
        scored = compute_logps_tree(model, ids, mask, score, token_budget=24, merge_tiny_nodes=merge)
    assert (scored.logps - dense.logps.detach()).abs().max().item() < 1e-5


@pytest.mark.parametrize("merge", [True, False])
def test_chunked_backward_tree_exact_with_and_without_merging(merge):
    model = build_model("qwen2")
    rows = random_tree_rows(12, depth=4, branching=3)
    ids, mask, score = pad_rows(rows, 12)
    assert merge_decisions(build_trie(*_justify(rows))).sum() >= 3
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(5))

    def loss_fn(out, chunk):
        return (out.logps * weights[chunk]).sum() + (out.entropy * weights[chunk].flip(1)).sum()

    dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    reference = parameter_grads(model, loss_fn(dense, torch.arange(len(rows))))
    for rows_per_chunk in (1, 4):
        out = chunked_backward_tree(
            model,
            ids,
            mask,
            score,
            loss_fn,
            rows_per_chunk=rows_per_chunk,
            return_entropy=True,
            merge_tiny_nodes=merge,
        )
        assert (out.logps - dense.logps.detach()).abs().max().item() < 1e-5
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        assert max_relative_grad_error(grads, reference) < 1e-4, rows_per_chunk


def test_merge_tiny_nodes_must_be_a_bool():
    model = build_model("llama")
    ids, mask, score = pad_rows(random_tree_rows(1, depth=2, branching=2), 1)
    with pytest.raises(TypeError, match="merge_tiny_nodes must be True or False"):
        compute_logps_tree(model, ids, mask, score, merge_tiny_nodes=1)
    with pytest.raises(TypeError, match="merge_tiny_nodes must be True or False"):
        chunked_backward_tree(model, ids, mask, score, lambda out, rows: out.logps.sum(), merge_tiny_nodes="yes")


def test_one_token_forks_are_split_into_their_children():
    """A one-token node between a parent and children (what a hybrid's recurrent layers could only continue through
    their one-token decode path) goes to the front of each child; a row that ends at it gets a leaf of its own; a
    one-token top-level node, a one-token leaf and a child of a split node (now two tokens long) stay."""
    rows = [
        [1, 2, 3, 4, 5],  # [3] forks: one token below [1 2] above [4 5] and [6 7]
        [1, 2, 3, 6, 7],
        [1, 2, 3],  # a row ends at [3]
        [1, 2, 8],  # [8]: a one-token leaf
        [9, 10],  # [9]: a one-token top-level node above [10] and [11 12]
        [9, 11, 12],
        [1, 2, 3, 4, 5, 13, 14],  # [4 5] gets [3]; its children stay as they are
        [1, 2, 3, 4, 5, 15],
    ]
    trie = build_trie(*_justify(rows))
    assert sorted(_node_tokens(trie)) == sorted([[1, 2], [3], [4, 5], [6, 7], [8], [9], [10], [11, 12], [13, 14], [15]])
    split = split_one_token_forks(trie)
    _check_merged(split, rows)
    assert sorted(_node_tokens(split)) == sorted(
        [[1, 2], [3], [3, 4, 5], [3, 6, 7], [8], [9], [10], [11, 12], [13, 14], [15]]
    )
    tokens = _node_tokens(split)
    leaf = tokens.index([3])
    assert int(split.subtree_end[leaf]) == leaf + 1 and int(split.row_end[2]) == leaf
    for node in range(split.num_nodes):
        has_children = int(split.subtree_end[node]) > node + 1
        assert not (split.node_length[node] == 1 and split.parent[node] >= 0 and has_children)
    assert split_one_token_forks(split) is split  # nothing left to split
    for seed in range(5):
        random_rows = random_tree_rows(seed, depth=4, branching=3)
        _check_merged(split_one_token_forks(build_trie(*_justify(random_rows))), random_rows)
