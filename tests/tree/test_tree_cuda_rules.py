"""CUDA's SDPA rules on the prefix tree's expand layout, checked on CPU on the fused-kernel path (the branch taken on
CUDA, selected here for "cpu"), as tests/backends/test_expand_cuda_rules.py checks them for batches:

- every additive node mask handed to SDPA has rows that start every 16 elements (the memory-efficient kernel copies
  a mask with unaligned strides in every call, and saves the copy for backward), and says exactly what the trie
  allows;
- a root call of equal-length nodes runs SDPA with ``is_causal=True`` and no mask;
- the kernel is chosen through ``sdpa_kernels`` (torch's checks; KV heads repeated only for a kernel that rejects
  grouped heads);
and log-probs and every parameter's gradient stay exact against dense.
"""

from __future__ import annotations

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.sdpa_spy import SdpaCalls, aligned_rows
from support.tiny_models import build_model
from support.trees import pad_rows, planned_node_calls, random_tree_rows, token_visibility
from torch.nn.attention import SDPBackend, sdpa_kernel

from shared_prefix_logps import compute_logps_tree
from shared_prefix_logps.backends import sdpa_kernels
from shared_prefix_logps.tree.attention import node_mask

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEAD_DIM = 8  # the tiny models' head size; the priority probe's own call has 64


def spied_tree_pass(monkeypatch, model, ids, mask, score, sdpa=None, **options):
    """Calls of the library's tree pass (forward with gradients, then backward) to SDPA, and the output;
    ``options`` go to ``compute_logps_tree``."""
    spy = SdpaCalls(sdpa or torch.nn.functional.scaled_dot_product_attention)
    with monkeypatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
        out = compute_logps_tree(model, ids, mask, score, return_entropy=True, **options)
        out.logps.sum().backward()
    model.zero_grad(set_to_none=True)
    return [call for call in spy.calls if call["head_dim"] == HEAD_DIM]


def shared_prompt_rows(prompt_len: int, suffixes: list[int], seed: int = 0):
    """(ids, mask, score): rows of one shared ``prompt_len``-token prompt and suffixes of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 101, (prompt_len,), generator=gen).tolist()
    rows = [system + torch.randint(0, 101, (n,), generator=gen).tolist() for n in suffixes]
    return pad_rows(rows, seed, hole_rate=0.0)


@pytest.mark.usefixtures("fused_path_on_cpu")
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])  # gemma2's softcap: explicit scores, no SDPA
def test_every_tree_mask_handed_to_sdpa_has_aligned_rows_and_results_are_exact(family, monkeypatch):
    model = build_model(family, layers=2)
    ids, mask, score = pad_rows(random_tree_rows(3, depth=3, branching=3, max_segment=6), 3)
    calls = spied_tree_pass(monkeypatch, model, ids, mask, score)
    masks = [call["mask"] for call in calls if call["mask"] is not None]
    assert masks and any(m.shape[-1] % 16 for m in masks), [tuple(m.shape) for m in masks]
    for m in masks:
        assert aligned_rows(m), (tuple(m.shape), m.stride())
    # Every call on the fused path ran inside the kernel choice's context (off CUDA torch's checks accept no fused
    # kernel, so the choice is the math kernel alone).
    assert all(call["enabled"] == ("MATH",) for call in calls)
    tree = compute_logps_tree(model, ids, mask, score, return_entropy=True)
    dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    assert (tree.logps - dense.logps).abs().max().item() <= 1e-5
    assert (tree.entropy - dense.entropy).abs().max().item() <= 1e-5
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(tree)), parameter_grads(model, weighted_loss(dense))
    )
    assert grad_err <= 1e-4


@pytest.mark.usefixtures("fused_path_on_cpu")
def test_root_call_of_a_shared_prompt_runs_causal_without_mask(monkeypatch):
    layers = 2
    model = build_model("llama", layers=layers)
    # Unmerged: the 12-token prompt saves 24 tokens, fewer than the tiny-node rule's threshold, and would be merged.
    calls = spied_tree_pass(monkeypatch, model, *shared_prompt_rows(12, [3, 5, 4]), merge_tiny_nodes=False)
    root = [call for call in calls if call["key_len"] == 12]
    children = [call for call in calls if call["key_len"] == 12 + 5]  # ancestors + the longest child
    assert len(root) == 2 * layers and len(children) == 2 * layers  # forward and backward's recomputation
    assert all(call["mask"] is None and call["is_causal"] for call in root)
    assert all(call["mask"] is not None and not call["is_causal"] for call in children)
    # Two top-level nodes of different lengths are padded rows: a mask.
    gen = torch.Generator().manual_seed(1)
    rows = [torch.randint(0, 101, (n,), generator=gen).tolist() for n in (6, 9)]
    calls = spied_tree_pass(monkeypatch, model, *pad_rows(rows, 1, hole_rate=0.0))
    assert calls and all(call["mask"] is not None and not call["is_causal"] for call in calls)


@pytest.mark.parametrize("window", [None, 1, 2, 5, 9])
@pytest.mark.parametrize("seed", range(3))
def test_node_mask_is_what_the_trie_allows(window, seed):
    trie, calls = planned_node_calls(random_tree_rows(seed, depth=4, branching=3, max_segment=5), rows_per_chunk=2)
    assert len(calls) > trie.depth.max()  # later chunks' calls, over several earlier calls' stores
    for call in calls:
        mask = node_mask(call, window, torch.float32)
        assert aligned_rows(mask)
        assert set(mask.unique().tolist()) <= {0.0, float("-inf")}
        shown = mask[:, 0] == 0  # (S, Lmax, A + Lmax)
        allowed = token_visibility(trie, call, window)  # (T, store + T)
        store = call.store_node.numel()
        valid, num_ancestors = call.pack_valid, call.ancestor_valid.shape[1]
        for s in range(valid.shape[0]):
            tokens = call.pack_index[s][valid[s]]
            expected = torch.zeros(tokens.numel(), shown.shape[-1], dtype=torch.bool)
            slots = call.ancestor_valid[s].nonzero().squeeze(1)
            expected[:, slots] = allowed[tokens][:, call.ancestor_index[s, slots]]
            expected[:, num_ancestors : num_ancestors + tokens.numel()] = allowed[tokens][:, store + tokens]
            assert torch.equal(shown[s, : tokens.numel()], expected), (s, window)
            # Padded query rows see something (no NaN), padded keys are seen by no real query.
            assert shown[s].any(-1).all()


# ---- kernel choice under CUDA's rules -------------------------------------------------------------------------------


def _torch_2_11_sm80(kernel, query, key, value, mask, dropout, is_causal, enable_gqa):
    """torch 2.11 on sm80: flash takes no mask (grouped heads natively), the memory-efficient kernel no grouped
    heads, cuDNN nothing."""
    grouped = key.shape[1] != query.shape[1]
    if kernel == "FLASH_ATTENTION":
        return mask is None and (not grouped or enable_gqa)
    return kernel == "EFFICIENT_ATTENTION" and not grouped


_REAL_SDPA = torch.nn.functional.scaled_dot_product_attention


def _math_on_cpu(query, key, value, attn_mask=None, **kwargs):
    # The numbers come from torch's CPU math kernel, whatever the emulated choice enabled.
    with sdpa_kernel([SDPBackend.MATH]):
        return _REAL_SDPA(query, key, value, attn_mask=attn_mask, **kwargs)


@pytest.mark.usefixtures("fused_path_on_cpu")
def test_kernel_choice_goes_through_torchs_checks_and_repeats_heads_only_when_needed(monkeypatch):
    monkeypatch.setattr(sdpa_kernels, "accepts", _torch_2_11_sm80)
    model = build_model("llama", layers=2)  # 4 query heads over 2 KV heads
    ids, mask, score = shared_prompt_rows(12, [3, 5, 4], seed=2)
    calls = spied_tree_pass(monkeypatch, model, ids, mask, score, sdpa=_math_on_cpu)
    root = [call for call in calls if call["mask"] is None]
    masked = [call for call in calls if call["mask"] is not None]
    assert root and masked
    assert all(call["enabled"] == ("FLASH_ATTENTION",) and call["gqa"] and not call["same_heads"] for call in root)
    assert all(call["enabled"] == ("EFFICIENT_ATTENTION",) and call["same_heads"] for call in masked)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _math_on_cpu)
    tree = compute_logps_tree(model, ids, mask, score)
    dense = compute_logps_tree(model, ids, mask, score, backend="dense")
    assert (tree.logps - dense.logps).abs().max().item() <= 1e-5
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(tree)), parameter_grads(model, weighted_loss(dense))
    )
    assert grad_err <= 1e-4
