"""The flex layout's tree BlockMasks, built from the trie's structure: block for block what ``create_block_mask``
builds from the mask function, what flex's CUDA kernel reads from them (``support.block_sparse``: the mask function
on partial blocks only, every pair of a full block) is exactly what the trie allows, and results stay exact against
dense when attention reads only the listed blocks.

On CPU flex_attention's eager implementation evaluates the mask function at every pair and ignores the block lists,
so a wrongly listed block would go unnoticed without reading the lists as the kernel does.
"""

from __future__ import annotations

import pytest
import torch
from support.block_sparse import block_sets, kernel_attention, kernel_visibility
from support.tiny_models import build_model
from support.trees import pad_rows, planned_node_calls, random_tree_rows, token_visibility

from shared_prefix_logps import compute_logps_tree
from shared_prefix_logps.backends import flex
from shared_prefix_logps.tree.flex import tree_block_mask

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_torch_thread"),
]

CPU = torch.device("cpu")


@pytest.mark.parametrize("seed, rows_per_chunk", [(0, 3), (5, 3), (2, 4)])
def test_tree_block_masks_are_what_the_trie_allows_read_like_the_kernel(seed, rows_per_chunk):
    """Nodes of up to 70 tokens (node boundaries inside 128-token blocks, calls over several blocks), calls of later
    chunks attending over stores whose nodes are out of depth-first order; windows shorter and longer than a block."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows = random_tree_rows(seed, depth=4, branching=3, max_segment=70)
    trie, calls = planned_node_calls(rows, rows_per_chunk=rows_per_chunk)
    assert any(bool((call.store_node[1:] < call.store_node[:-1]).any()) for call in calls)
    assert max(call.num_tokens for call in calls) > flex.LENGTH_BUCKET
    assert max(call.store_node.numel() for call in calls) > flex.LENGTH_BUCKET
    for call in calls:
        n, keys = call.num_tokens, call.store_node.numel() + call.num_tokens
        q_len, kv_len = flex.padded_length(n, CPU), flex.padded_length(keys, CPU)
        for window in (None, 3, 70, 200):
            ours = tree_block_mask(call, window, q_len, kv_len)
            seen = kernel_visibility(ours)
            assert torch.equal(seen[:n, :keys], token_visibility(trie, call, window)), window
            assert not seen[n:].any() and not seen[:, keys:].any()
            theirs = create_block_mask(ours.mask_mod, None, None, q_len, kv_len, device="cpu")
            mine, reference = block_sets(ours), block_sets(theirs)
            for name in mine:
                assert torch.equal(mine[name], reference[name]), (name, window)


def _kernel_flex_entry(query, key, value, block_mask, score_mod, scale, enable_gqa, kernel_options, aux):
    """Stands in for flex_attention: attention as the CUDA kernel reads ``block_mask``."""
    assert not aux, "these models request no log-sum-exp"
    assert kernel_options is None  # CPU: no Triton kernel options
    return kernel_attention(query, key, value, block_mask, scale, score_mod)


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
