"""The tiny-node rule: a trie node whose sharing saves fewer tokens than a node costs is merged into its children.

Forwarding a node once for all rows through it saves ``length * (receivers - 1)`` tokens over forwarding its tokens
again in each of its ``receivers`` (the children that will hold its tokens), but each node costs a fixed amount on
its own: in the depth-first walk (no-grad scoring, ``chunked_backward_tree``) one more node call on the paths through
it, with gradients one more trie depth (one more forward) where it lies on a deepest path, and in both one more
ancestor to gather and attend over. A node of a few tokens (rollouts forked one token apart, a one-token common
start) saves less than that. Merging it moves its tokens to the front of each child, at the same positions: each
child's rows see the same tokens at the same positions, so log-probs and gradients are those of the unmerged trie;
only the merged tokens are forwarded once per receiver instead of once.

The rule, decided bottom-up (a node after its children, so that ``receivers`` counts the nodes its tokens end up in):
a node is merged when some row passes below it, no row ends at it (its tokens would then need a node of their own),
and ``length * (receivers - 1) < min_saved_tokens``, where ``receivers`` sums over its children: 1 for a kept child,
the child's own receivers for a merged one.
"""

from __future__ import annotations

import torch

from .trie import PrefixTrie, assemble_trie, build_trie

#: A node is merged into its children when sharing it saves fewer forwarded tokens than this: the fixed cost of one
#: more node call (one more trie depth) in forwarded-token equivalents. Measured on CPU with ``python -m
#: shared_prefix_logps.bench.node_cost`` (float32, Qwen2 shape: hidden 256, 2 layers, vocabulary 2000, one thread; a
#: 64-token shared prompt, a fork node of m = 1..32 tokens above 4 leaves of 32 tokens, unmerged vs merged): the
#: break-even of three runs on a shared, loaded 2-core machine was 46 / 35 / 56 tokens with gradients (forward and
#: backward; a node call 28-58 ms, a token 0.6-1.7 ms) and 57 / 97 / 52 without (a call 16-25 ms, a token 0.26-0.35
#: ms). Taken on the low side, as a merge that forwards more than it saves loses time and memory, while keeping a
#: node loses at most the call.
#: Prediction, not measured: on a GPU a node call's fixed cost (kernel launches of every layer, the ancestors'
#: gather) stays while the per-token cost of a small call is close to zero, so the break-even there should be
#: hundreds of tokens or more; re-measure on the target GPU before raising this.
MERGE_BELOW_SAVED_TOKENS = 40


def merge_decisions(trie: PrefixTrie, min_saved_tokens: int = MERGE_BELOW_SAVED_TOKENS) -> torch.Tensor:
    """(num_nodes,) bool, True for the nodes the tiny-node rule merges into their children (see the module)."""
    num_nodes = trie.num_nodes
    has_children = torch.zeros(num_nodes, dtype=torch.bool)
    parents = trie.parent.tolist()
    for parent in parents:
        if parent >= 0:
            has_children[parent] = True
    row_ends = torch.zeros(num_nodes, dtype=torch.bool)
    ends = trie.row_end[trie.row_end >= 0]
    row_ends[ends] = True
    lengths = trie.node_length.tolist()
    merged = [False] * num_nodes
    receivers = [0] * num_nodes  # for each node, the kept nodes its tokens reach (1 if it is kept)
    kept_below = [0] * num_nodes  # per node, the sum of its children's receivers
    for node in range(num_nodes - 1, -1, -1):  # children have larger numbers: every child is decided first
        eligible = bool(has_children[node]) and not bool(row_ends[node])
        merged[node] = eligible and lengths[node] * (kept_below[node] - 1) < min_saved_tokens
        receivers[node] = kept_below[node] if merged[node] else 1
        if parents[node] >= 0:
            kept_below[parents[node]] += receivers[node]
    return torch.tensor(merged, dtype=torch.bool)


def merge_tiny_nodes(trie: PrefixTrie, min_saved_tokens: int = MERGE_BELOW_SAVED_TOKENS) -> PrefixTrie:
    """``trie`` with the nodes :func:`merge_decisions` picks merged into their children: each kept node's tokens
    preceded by those of its merged ancestors just above it, its parent the nearest kept ancestor. The result's
    tokens are no longer unique (a merged node's tokens are in each node that received them); it is ``trie`` itself
    when nothing is merged."""
    merged = merge_decisions(trie, min_saved_tokens)
    if not merged.any():
        return trie
    parents = trie.parent.tolist()
    new_id = [-1] * trie.num_nodes
    token_runs, starts, new_parents = [], [], []
    for node in range(trie.num_nodes):  # pre-order filtered to the kept nodes is the merged trie's pre-order
        if merged[node]:
            continue
        chain = [node]
        while parents[chain[-1]] >= 0 and merged[parents[chain[-1]]]:
            chain.append(parents[chain[-1]])
        top = chain[-1]
        new_id[node] = len(token_runs)
        token_runs.append(torch.cat([_tokens(trie, n) for n in reversed(chain)]))
        starts.append(int(trie.node_start[top]))
        new_parents.append(new_id[parents[top]] if parents[top] >= 0 else -1)
    row_end = [new_id[int(end)] if end >= 0 else -1 for end in trie.row_end]
    return assemble_trie(token_runs, starts, new_parents, row_end, trie.row_length)


def split_one_token_forks(trie: PrefixTrie) -> PrefixTrie:
    """``trie`` without one-token nodes that start from a parent's state and hand theirs on: each such node (one
    token, a parent, children) is merged into its children, its token put in front of each child's at the same
    position; rows that end at it get a leaf of their own holding that token. Exact as the tiny-node merge is (every
    row sees the same tokens at the same positions); the token is forwarded once per child (and leaf) instead of once.

    Why: a linear-attention hybrid's recurrent layer runs a one-token segment from a state through its one-token
    decode path, whose kernel may have no backward (``recurrent/served.py``); a node of two or more tokens, or a
    one-token leaf (which keeps no end state, ``recurrent/layer.py``), takes the chunked path. A node whose parent is
    merged this way receives its parent's token, so no merged node has a merged parent. Returns ``trie`` itself when
    no node qualifies."""
    num_nodes = trie.num_nodes
    parents = trie.parent.tolist()
    has_children = (trie.subtree_end > torch.arange(num_nodes) + 1).tolist()
    lengths = trie.node_length.tolist()
    merged = [False] * num_nodes
    for node in range(num_nodes):  # pre-order: a parent is decided before its children
        parent = parents[node]
        merged[node] = lengths[node] == 1 and parent >= 0 and not merged[parent] and has_children[node]
    if not any(merged):
        return trie
    ends_at = [[] for _ in range(num_nodes)]
    for row, end in enumerate(trie.row_end.tolist()):
        if end >= 0:
            ends_at[end].append(row)
    new_id = [-1] * num_nodes  # a kept node's new number; a merged node's leaf copy's, if rows end at it
    token_runs, starts, new_parents = [], [], []
    for node in range(num_nodes):
        parent = parents[node]
        if merged[node]:
            if ends_at[node]:  # a leaf for the rows that end here, in the merged node's place among its siblings
                new_id[node] = len(token_runs)
                token_runs.append(_tokens(trie, node))
                starts.append(int(trie.node_start[node]))
                new_parents.append(new_id[parent])
            continue
        top = parent if parent >= 0 and merged[parent] else node
        above = parents[top]
        token_runs.append(torch.cat([_tokens(trie, top), _tokens(trie, node)]) if top != node else _tokens(trie, node))
        starts.append(int(trie.node_start[top]))
        new_parents.append(new_id[above] if above >= 0 else -1)
        new_id[node] = len(token_runs) - 1
    row_end = [new_id[int(end)] if end >= 0 else -1 for end in trie.row_end]
    return assemble_trie(token_runs, starts, new_parents, row_end, trie.row_length)


def rows_trie(rows, merge_below: int, *, one_token_forks: bool = True) -> PrefixTrie:
    """The searched trie of validated ``rows`` (:class:`~shared_prefix_logps.inputs.TreeRows`): the rows' trie, with
    the nodes that save fewer than ``merge_below`` tokens merged into their children (0: none), and without
    ``one_token_forks`` the one-token nodes between a parent and children merged into those children too
    (:func:`split_one_token_forks`)."""
    trie = build_trie(rows.justified(), rows.lengths)
    trie = merge_tiny_nodes(trie, merge_below) if merge_below > 0 else trie
    return trie if one_token_forks else split_one_token_forks(trie)


def merge_threshold(merge_tiny_nodes: bool) -> int:
    """The entry points' ``merge_tiny_nodes`` keyword as the threshold of :func:`rows_trie`."""
    if not isinstance(merge_tiny_nodes, bool):
        raise TypeError(f"merge_tiny_nodes must be True or False, got {type(merge_tiny_nodes).__name__}")
    return MERGE_BELOW_SAVED_TOKENS if merge_tiny_nodes else 0


def _tokens(trie: PrefixTrie, node: int) -> torch.Tensor:
    offset = int(trie.node_offset[node])
    return trie.tokens[offset : offset + int(trie.node_length[node])]
