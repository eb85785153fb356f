"""The flex layout's structure-built BlockMasks of node calls: block for block what ``create_block_mask`` builds from
the mask function, what flex's CUDA kernel reads from them is exactly what the trie allows (tries of any depth, and
grouped batches' two-level tries), results exact against dense when attention reads only the listed blocks, and a
~1M-query mask built in seconds and memory proportional to its blocks.

On CPU flex_attention runs its eager implementation, which evaluates the mask function everywhere and ignores the
block lists; ``support.block_sparse`` reads the lists the way the CUDA kernel does (mask function on partial blocks
only, nothing on full ones), so a block listed wrongly changes results here as it would on a GPU.
"""

from __future__ import annotations

import time

import pytest
import torch
from support.block_sparse import block_sets, kernel_attention, kernel_visibility
from support.tiny_models import build_model, make_batch
from support.trees import grouped_batch_calls, pad_rows, planned_node_calls, random_tree_rows, token_visibility

from shared_prefix_logps import compute_logps, compute_logps_tree
from shared_prefix_logps.backends import flex
from shared_prefix_logps.backends.flex_blocks import Links, Segments, segments_of, structured_block_mask
from shared_prefix_logps.backends.layouts import LayerCall
from shared_prefix_logps.bench.memory import LiveTensorBytes
from shared_prefix_logps.engine.call_planner import CallPlanner, ScoredPairs
from shared_prefix_logps.engine.trie import grouped_trie, levels

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

CPU = torch.device("cpu")


def _assert_same_blocks(ours, theirs):
    """Partial and full block sets equal, on the kv side and (when built) the transposed q side."""
    mine, reference = block_sets(ours), block_sets(theirs)
    for name in mine:
        assert torch.equal(mine[name], reference[name]), name
    assert torch.equal(ours.to_dense(), theirs.to_dense())


WINDOWS = [None, 3, 70, 200]


def flex_q_blocks_optional():
    """Whether this torch's BlockMask may omit the backward (q-side) indices."""
    from shared_prefix_logps.backends.flex_blocks import _q_blocks_optional

    return _q_blocks_optional()


def _check_calls(trie, calls):
    from torch.nn.attention.flex_attention import create_block_mask

    for call in calls:
        n, keys = call.num_tokens, call.store_node.numel() + call.num_tokens
        q_len, kv_len = flex.padded_length(n, CPU), flex.padded_length(keys, CPU)
        for window in WINDOWS:
            ours = flex.node_block_mask(call, window, q_len, kv_len)
            seen = kernel_visibility(ours)
            assert torch.equal(seen[:n, :keys], token_visibility(trie, call, window)), window
            assert not seen[n:].any() and not seen[:, keys:].any()
            _assert_same_blocks(ours, create_block_mask(ours.mask_mod, None, None, q_len, kv_len, device="cpu"))


@pytest.mark.parametrize("seed, rows_per_chunk", [(0, 3), (5, 3), (2, 4)])
def test_node_masks_of_tries_are_what_the_trie_allows_read_like_the_kernel(seed, rows_per_chunk):
    """Nodes of up to 70 tokens (node boundaries inside 128-token blocks, calls over several blocks), calls of later
    chunks attending over stores whose nodes are out of depth-first order; windows shorter and longer than a block."""
    rows = random_tree_rows(seed, depth=4, branching=3, max_segment=70)
    trie, calls = planned_node_calls(rows, rows_per_chunk=rows_per_chunk)
    assert any(bool((call.store_node[1:] < call.store_node[:-1]).any()) for call in calls)
    assert max(call.num_tokens for call in calls) > flex.LENGTH_BUCKET
    assert max(call.store_node.numel() for call in calls) > flex.LENGTH_BUCKET
    _check_calls(trie, calls)


@pytest.mark.parametrize("seed", range(4))
def test_node_masks_of_grouped_batches_are_what_they_allow_read_like_the_kernel(seed):
    """Two-level tries of grouped batches: prompts of 1 to 300 tokens, 1 to 4 generations, completions of 0 to 200
    tokens, rows in random prompt order (trainer-shaped batches), the prompts' call then the completions'."""
    gen = torch.Generator().manual_seed(seed)
    num_prompts, generations = (int(torch.randint(1, 5, (), generator=gen)) for _ in range(2))
    prompt_len = torch.randint(1, 301, (num_prompts,), generator=gen)
    width = int(prompt_len.max())
    pmask = torch.arange(width)[None, :] >= (width - prompt_len)[:, None]
    comp_len = torch.randint(0, 201, (num_prompts * generations,), generator=gen)
    comp_len[0] = max(1, int(comp_len[0]))
    cmask = torch.arange(int(comp_len.max()))[None, :] < comp_len[:, None]
    group = torch.randint(0, num_prompts, (num_prompts * generations,), generator=gen)
    group[:num_prompts] = torch.arange(num_prompts)
    trie = grouped_trie(
        torch.randint(0, 101, pmask.shape, generator=gen) * pmask,
        pmask,
        torch.ones_like(cmask, dtype=torch.long) * cmask,
        cmask,
        group,
    )
    planner = CallPlanner(trie, ScoredPairs(*(torch.zeros(0, dtype=torch.long),) * 3), "flex")
    calls = [planner.plan(nodes) for nodes in levels(trie)]
    assert len(calls) == 2 and calls[1].store_node.numel() == int(prompt_len.sum())
    _check_calls(trie, calls)


def test_a_tree_of_segments_equals_create_block_mask():
    """Links beyond two levels (a prefix tree: root, two children, a grandchild): each node's queries see every
    ancestor whole and their own node causally, keys laid out in a different order from the queries."""
    from torch.nn.attention.flex_attention import create_block_mask

    # Nodes: 0 root (150 tokens), 1 and 2 children (200, 90), 3 child of 1 (170). Positions continue along paths.
    lengths = torch.tensor([150, 200, 90, 170])
    first_pos = torch.tensor([0, 150, 150, 350])
    parents = {0: [], 1: [0], 2: [0], 3: [0, 1]}
    key_order = [2, 0, 3, 1]  # keys packed in another order than queries
    key_start = torch.zeros(4, dtype=torch.long)
    offset = 0
    for node in key_order:
        key_start[node] = offset
        offset += int(lengths[node])
    q_start = torch.cumsum(lengths, 0) - lengths
    queries = Segments(start=q_start, length=lengths, position=first_pos)
    keys = Segments(start=key_start, length=lengths, position=first_pos)
    query_ids, key_ids, causal = [], [], []
    for node, ancestors in parents.items():
        for other in ancestors + [node]:
            query_ids.append(node)
            key_ids.append(other)
            causal.append(other == node)
    links = Links(query=torch.tensor(query_ids), key=torch.tensor(key_ids), causal=torch.tensor(causal))
    total = int(lengths.sum())
    length = flex.padded_length(total, CPU)
    node_of_q = torch.full((length,), -1).index_copy(0, torch.arange(total), torch.arange(4).repeat_interleave(lengths))
    pos_of_q = torch.zeros(length, dtype=torch.long)
    node_of_k, pos_of_k = torch.full((length,), -2), torch.zeros(length, dtype=torch.long)
    for node in range(4):
        n = int(lengths[node])
        pos_of_q[q_start[node] : q_start[node] + n] = first_pos[node] + torch.arange(n)
        node_of_k[key_start[node] : key_start[node] + n] = node
        pos_of_k[key_start[node] : key_start[node] + n] = first_pos[node] + torch.arange(n)
    sees = torch.zeros(4, 4, dtype=torch.bool)  # sees[q node, k node]: k is a proper ancestor of q
    for node, ancestors in parents.items():
        sees[node, ancestors] = True
    for window in (None, 60, 250):
        limit = 2**40 if window is None else window

        def mask_mod(b, h, q_idx, kv_idx, limit=limit):
            q_node, k_node = node_of_q[q_idx], node_of_k[kv_idx]
            q_pos, k_pos = pos_of_q[q_idx], pos_of_k[kv_idx]
            ancestor = sees[q_node.clamp(min=0), k_node.clamp(min=0)] & (q_node >= 0) & (k_node >= 0)
            itself = (q_node == k_node) & (k_pos <= q_pos)
            return (ancestor | itself) & (q_pos - k_pos < limit)

        ours = structured_block_mask(
            queries, keys, links, q_len=length, kv_len=length, window=window, mask_mod=mask_mod
        )
        theirs = create_block_mask(mask_mod, None, None, length, length, device="cpu")
        _assert_same_blocks(ours, theirs)


def test_segments_that_are_not_runs_are_refused():
    positions = torch.arange(6)
    with pytest.raises(ValueError, match="non-decreasing"):
        segments_of(torch.tensor([0, 0, 1, 1, 0, 0]), positions, 2)
    with pytest.raises(ValueError, match="advance by one"):
        segments_of(torch.tensor([0, 0, 0, 1, 1, 1]), torch.tensor([0, 1, 3, 0, 1, 2]), 2)
    segments = segments_of(torch.tensor([0, 0, 0, 2, 2, 2]), torch.tensor([5, 6, 7, 0, 1, 2]), 3, offset=10)
    assert segments.start.tolist() == [10, 13, 13] and segments.length.tolist() == [3, 0, 3]
    assert segments.position[[0, 2]].tolist() == [5, 0]
    empty = Links(query=torch.zeros(0, dtype=torch.long), key=torch.zeros(0, dtype=torch.long), causal=torch.zeros(0))
    with pytest.raises(ValueError, match="q_len"):
        structured_block_mask(segments, segments, empty, q_len=100, kv_len=128, window=None, mask_mod=None)


def _kernel_flex_entry(query, key, value, block_mask, score_mod, scale, enable_gqa, kernel_options, aux):
    """Stands in for flex_attention: attention as the CUDA kernel reads ``block_mask``."""
    assert not aux, "these models request no log-sum-exp"
    assert kernel_options is None  # CPU: no Triton kernel options
    return kernel_attention(query, key, value, block_mask, scale, score_mod)


@pytest.mark.parametrize("family", ["gemma2", "mistral", "qwen2"])
@pytest.mark.parametrize("shape", [(3, 1, 150, 30), (2, 4, 60, 140), (4, 2, 13, 8)])
def test_grouped_results_exact_when_attention_reads_only_the_listed_blocks(family, shape, monkeypatch):
    """Gemma2 (softcaps, windows of 5 and none), Mistral (window 6), Qwen2; G=1 and larger; one-token prompts and
    empty completion rows (make_batch); prompts or completions longer than a block."""
    monkeypatch.setattr(flex, "_flex_entry", _kernel_flex_entry)
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(*shape, seed=sum(shape))
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    with torch.no_grad():
        ours = compute_logps(model, prompts, comps, backend="flex", **kwargs)
        dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    assert (ours.logps - dense.logps).abs().max() <= 1e-5
    assert (ours.entropy - dense.entropy).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma2", "mistral"])
@pytest.mark.parametrize("budget, max_segment", [(1, 70), (None, 70), (None, 300)])
def test_tree_results_exact_when_attention_reads_only_the_listed_blocks(family, budget, max_segment, monkeypatch):
    """Gemma2 (softcaps, a window of 5 and none), Mistral (window 6), Llama; the walk one row at a time or all at
    once; calls whose queries and ancestor stores span several blocks, nodes longer than a block (full blocks,
    where the kernel does not run the mask function)."""
    monkeypatch.setattr(flex, "_flex_entry", _kernel_flex_entry)
    model = build_model(family)
    ids, mask, score = pad_rows(random_tree_rows(2, depth=3, branching=2, max_segment=max_segment), 2)
    with torch.no_grad():
        ours = compute_logps_tree(model, ids, mask, score, return_entropy=True, token_budget=budget, backend="flex")
        dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    assert (ours.logps - dense.logps).abs().max().item() <= 1e-5
    assert (ours.entropy - dense.entropy).abs().max().item() <= 1e-5


def test_a_million_query_mask_builds_in_seconds_and_memory_proportional_to_its_blocks(monkeypatch):
    """8 prompts x 4096 prompt tokens x 16 generations x 8192 completion tokens: the completions' call has 1,048,576
    queries over 1,081,344 keys (1.1e12 pairs). The mask is taken from the layout's entry point (the attention call
    itself is replaced by a probe), as a forward would build it. Evaluating the mask function at every pair (what
    create_block_mask does) took 35 s and 13 GB at 32k queries and grows with the square of the batch."""
    prompts, prefix, generations, completion = 8, 4096, 16, 8192
    prompts_call, call = grouped_batch_calls(prompts, prefix, generations, completion)
    n = call.num_tokens
    built = {}

    def probe(query, key, value, block_mask, *args, **kwargs):
        built["mask"] = block_mask
        return query.transpose(1, 2)

    monkeypatch.setattr(flex, "_attend", probe)
    query = torch.zeros(1, 1, n, 1)
    store = torch.zeros(1, prompts_call.num_tokens, 1)
    tracker = LiveTensorBytes()
    start = time.perf_counter()
    with torch.no_grad(), tracker:
        flex.node_attention(
            query, query, query, LayerCall(None, call, [(store, store)], {}, None, {}, needs_grad=False)
        )
    seconds = time.perf_counter() - start
    mask = built["mask"]

    # The exact block counts of this layout (everything aligned to 128): a query block of completion block k sees
    # its prompt's 32 blocks and its row's k earlier blocks whole, and its own diagonal block in part.
    per_row = completion // 128
    partial_expected = prompts * generations * per_row
    full_expected = prompts * generations * (per_row * prefix // 128 + per_row * (per_row - 1) // 2)
    partial, full = int(mask.kv_num_blocks.sum()), int(mask.full_kv_num_blocks.sum())
    assert (partial, full) == (partial_expected, full_expected)
    assert mask.q_indices is None or not flex_q_blocks_optional()  # scoring builds no backward indices

    # torch's format holds dense (Q_blocks, KV_blocks) int32 index arrays (2 x 264 MiB here); everything else is
    # bounded per visited block (measured: ~270 bytes per block).
    index_bytes = sum(t.numel() * t.element_size() for t in (mask.kv_indices, mask.full_kv_indices))
    assert tracker.peak <= index_bytes + 1024 * (partial + full), (tracker.peak, index_bytes, partial + full)
    assert seconds <= 60, seconds  # measured 1.5-6 s with the memory tracker on one shared core


# ---- host synchronizations of a mask build (what a CUDA run waits for) ----------------------------------------------

#: Operations that must not appear in a mask build: boolean-mask selection and assignment (a nonzero each on CUDA),
#: bincount (CUDA's reads the maximum first) and repeat_interleave left to count its output itself.
UNCOUNTED_SIZES = ("aten.bincount", "aten.index.", "aten.index_put", "aten.repeat_interleave")


def _syncs_of(build, *args, **kwargs):
    from support.host_syncs import HostSyncs

    with torch.no_grad(), HostSyncs() as syncs:
        build(*args, **kwargs)
    assert not [name for name in syncs.counts if name.startswith(UNCOUNTED_SIZES)], dict(syncs.counts)
    return syncs


def _mask_calls():
    """A grouped batch's prompts' and completions' calls (flex), and every call of a deeper trie."""
    trie = grouped_trie(
        torch.ones(2, 300, dtype=torch.long),
        torch.ones(2, 300, dtype=torch.bool),
        torch.ones(8, 100, dtype=torch.long),
        torch.ones(8, 100, dtype=torch.bool),
        torch.arange(2).repeat_interleave(4),
    )
    planner = CallPlanner(trie, ScoredPairs(*(torch.zeros(0, dtype=torch.long),) * 3), "flex")
    grouped = [planner.plan(nodes) for nodes in levels(trie)]
    _, deeper = planned_node_calls(random_tree_rows(5, depth=4, branching=3, max_segment=70), rows_per_chunk=3)
    return grouped + deeper


def test_a_mask_build_reads_nothing_of_the_device():
    """A node call moved to the device keeps its host copy, which the BlockMask is built from: the counter of what a
    CUDA run would wait for (device tensors tracked apart from host ones) sees no host sync in the build."""
    from shared_prefix_logps.bench.dispatch_count import DispatchCount

    for call in _mask_calls():
        n, keys = call.num_tokens, call.store_node.numel() + call.num_tokens
        q_len, kv_len = flex.padded_length(n, CPU), flex.padded_length(keys, CPU)
        for window, q_blocks in ((None, False), (70, True)):
            counter = DispatchCount()
            with torch.no_grad(), counter:
                on_device = call.to(CPU)  # the counter's copies stand for the device's tensors
                assert on_device.host is call
                mask = flex.node_block_mask(on_device, window, q_len, kv_len, q_blocks=q_blocks)
            assert counter.counts.num_syncs == 0, dict(counter.counts.syncs)
            assert counter.is_device(mask.kv_indices) and counter.is_device(mask.full_kv_num_blocks)


def test_a_mask_build_waits_for_the_device_a_handful_of_times():
    """Built from the device's tensors alone (a call without a host copy), each structure-built BlockMask reads back
    only what sizes its tensors: two run lists (a count and a check each), the node pairs with the store and inside
    the call (a nonzero each), two expansions' totals (handed to ``repeat_interleave`` as ``output_size``), the
    distinct blocks. (The two-level masks of before waited 43 and 35 times.)"""
    for call in _mask_calls():
        n, keys = call.num_tokens, call.store_node.numel() + call.num_tokens
        q_len, kv_len = flex.padded_length(n, CPU), flex.padded_length(keys, CPU)
        for window, q_blocks in ((None, False), (70, True)):
            syncs = _syncs_of(flex.node_block_mask, call, window, q_len, kv_len, q_blocks=q_blocks)
            assert syncs.total <= 9, dict(syncs.counts)
