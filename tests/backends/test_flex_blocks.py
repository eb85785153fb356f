"""The flex backend's structure-built BlockMasks: block for block what ``create_block_mask`` builds from the mask
function, what flex's CUDA kernel reads from them is exactly the batch's visibility, results exact against dense when
attention reads only the listed blocks, and a ~1M-query mask built in seconds and memory proportional to its blocks.

On CPU flex_attention runs its eager implementation, which evaluates the mask function everywhere and ignores the
block lists; ``support.block_sparse`` reads the lists the way the CUDA kernel does (mask function on partial blocks
only, nothing on full ones), so a block listed wrongly changes results here as it would on a GPU.
"""

from __future__ import annotations

import time

import pytest
import torch
from support.block_sparse import block_sets, kernel_attention, kernel_visibility
from support.flex_batches import expected_visibility, random_packed_batch, regular_packed_batch
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import compute_logps
from shared_prefix_logps.backends import flex
from shared_prefix_logps.backends.flex_blocks import Links, Segments, segments_of, structured_block_mask
from shared_prefix_logps.bench.memory import LiveTensorBytes

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_torch_thread"),
]

CPU = torch.device("cpu")


def _assert_same_blocks(ours, theirs):
    """Partial and full block sets equal, on the kv side and (when built) the transposed q side."""
    mine, reference = block_sets(ours), block_sets(theirs)
    for name in mine:
        assert torch.equal(mine[name], reference[name]), name
    assert torch.equal(ours.to_dense(), theirs.to_dense())


WINDOWS = [None, 1, 7, 128, 200, 333]


@pytest.mark.parametrize("seed", range(8))
def test_phase2_mask_equals_create_block_mask_and_the_batch(seed):
    from torch.nn.attention.flex_attention import create_block_mask

    context, num_prefix = random_packed_batch(seed)
    n = context.query_rows.numel()
    q_len, kv_len = flex._round_up(n, CPU), flex._round_up(n + num_prefix, CPU)
    for window in WINDOWS:
        for q_blocks in (False, True):
            ours = flex._shared_block_mask(context, n, num_prefix, q_len, kv_len, window, CPU, q_blocks=q_blocks)
            assert (ours.q_indices is not None) == (q_blocks or not flex_q_blocks_optional())
            theirs = create_block_mask(ours.mask_mod, None, None, q_len, kv_len, device="cpu")
            _assert_same_blocks(ours, theirs)
            expected = expected_visibility(context, num_prefix, q_len, kv_len, window)
            assert torch.equal(kernel_visibility(ours), expected), (seed, window)


def flex_q_blocks_optional():
    from shared_prefix_logps.backends.flex_blocks import _q_blocks_optional

    return _q_blocks_optional()


@pytest.mark.parametrize("seed", range(4))
def test_phase1_mask_equals_create_block_mask(seed):
    from torch.nn.attention.flex_attention import create_block_mask

    context, num_prefix = random_packed_batch(3 * seed + 101)  # seeds not multiples of 3 keep the first prefix
    capture = context.capture
    assert capture is not None and num_prefix > 0
    capture.needs_grad = True
    length = flex._round_up(num_prefix, CPU)
    for window in WINDOWS:
        ours = flex._capture_block_mask(capture, num_prefix, length, window, CPU, q_blocks=True)
        theirs = create_block_mask(ours.mask_mod, None, None, length, length, device="cpu")
        _assert_same_blocks(ours, theirs)
        segments, positions = capture.segments, capture.positions[0]
        expected = (segments[:, None] == segments[None]) & (positions[:, None] >= positions[None])
        if window is not None:
            expected &= positions[:, None] - positions[None] < window
        assert torch.equal(kernel_visibility(ours)[:num_prefix, :num_prefix], expected)
        assert not kernel_visibility(ours)[num_prefix:].any() and not kernel_visibility(ours)[:, num_prefix:].any()


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
    length = flex._round_up(total, CPU)
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
def test_results_exact_when_attention_reads_only_the_listed_blocks(family, shape, monkeypatch):
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


def test_a_million_query_mask_builds_in_seconds_and_memory_proportional_to_its_blocks(monkeypatch):
    """8 prompts x 4096 prefix tokens x 16 generations x 8192 completion tokens: 1,048,576 queries over 1,081,344
    keys (1.1e12 pairs). The mask is taken from the backend's Phase 2 entry point (the attention call itself is
    replaced by a probe), as a forward would build it. Evaluating the mask function at every pair (what
    create_block_mask does) took 35 s and 13 GB at 32k queries and grows with the square of the batch."""
    prompts, prefix, generations, completion = 8, 4096, 16, 8192
    context = regular_packed_batch(prompts, prefix, generations, completion)
    n = context.query_rows.numel()
    built = {}

    def probe(query, key, value, block_mask, *args, **kwargs):
        built["mask"] = block_mask
        return query.transpose(1, 2)

    monkeypatch.setattr(flex, "_attend", probe)
    query = torch.zeros(1, 1, n, 1)
    tracker = LiveTensorBytes()
    start = time.perf_counter()
    with torch.no_grad(), tracker:
        flex.packed_shared_attention(object(), query, query, query, context, None, {})
    seconds = time.perf_counter() - start
    mask = built["mask"]

    # The exact block counts of this layout (everything aligned to 128): a query block of completion block k sees
    # its prompt's 32 prefix blocks and its row's k earlier blocks whole, and its own diagonal block in part.
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


def test_a_mask_build_waits_for_the_device_a_handful_of_times():
    """Each structure-built BlockMask reads back from the device only what sizes its tensors: a segment count, the
    two expansions' totals (handed to ``repeat_interleave`` as ``output_size``), the distinct blocks, one read of its
    checks per segment list. These two masks waited 43 and 35 times before."""
    import types

    context = regular_packed_batch(2, 300, 4, 100)
    n, num_prefix = context.query_rows.numel(), 600
    q_len, kv_len = flex._round_up(n, CPU), flex._round_up(n + num_prefix, CPU)
    for q_blocks in (False, True):
        syncs = _syncs_of(flex._shared_block_mask, context, n, num_prefix, q_len, kv_len, 200, CPU, q_blocks=q_blocks)
        assert syncs.total <= 6, dict(syncs.counts)
    capture = context.capture
    phase1 = types.SimpleNamespace(segments=capture.segments, positions=capture.positions, needs_grad=True, masks={})
    length = flex._round_up(num_prefix, CPU)
    syncs = _syncs_of(flex._capture_block_mask, phase1, num_prefix, length, 7, CPU, q_blocks=True)
    assert syncs.total <= 5, dict(syncs.counts)


def test_a_tree_mask_build_waits_for_the_device_a_handful_of_times():
    from support.trees import planned_node_calls, random_tree_rows

    from shared_prefix_logps.tree.flex import tree_block_mask

    rows = random_tree_rows(5, depth=4, branching=3, max_segment=70)
    _, calls = planned_node_calls(rows, rows_per_chunk=3)
    for call in calls:
        n, keys = call.num_tokens, call.store_node.numel() + call.num_tokens
        q_len, kv_len = flex.padded_length(n, CPU), flex.padded_length(keys, CPU)
        syncs = _syncs_of(tree_block_mask, call, 70, q_len, kv_len)
        # Two run lists (a count and a check each), the node pairs (one nonzero), two expansions, the blocks.
        assert syncs.total <= 8, dict(syncs.counts)
