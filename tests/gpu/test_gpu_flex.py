"""CUDA checks of the flex backend's structure-built BlockMasks (marked ``gpu``, skipped without a CUDA device): block
for block what ``create_block_mask`` builds on the GPU, exact results against dense when inductor's kernel reads the
block lists (full blocks skip the mask function there, unlike on CPU), heads below 16 padded, and the 1M-query mask
built in seconds. Models have head_dim >= 16 except where padding is the point.
"""

from __future__ import annotations

import time

import pytest
import torch
from support.block_sparse import block_sets
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import build_model, make_batch
from support.trees import grouped_batch_calls, planned_node_calls, random_tree_rows

from shared_prefix_logps import compute_logps
from shared_prefix_logps.backends import flex
from shared_prefix_logps.backends.layouts import LayerCall

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
#: float32 on the GPU: kernels sum in other orders than the dense path, so a little more than on CPU.
FP32_LOGPS_TOL, FP32_GRAD_TOL = 1e-4, 1e-3


@pytest.fixture(autouse=True)
def real_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("seed", range(4))
def test_structure_masks_equal_create_block_mask_on_cuda(seed):
    from torch.nn.attention.flex_attention import create_block_mask

    _, calls = planned_node_calls(random_tree_rows(seed, depth=4, branching=3, max_segment=70), rows_per_chunk=3)
    for call in calls:
        call = call.to(CUDA)
        n, keys = call.num_tokens, call.store_node.numel() + call.num_tokens
        q_len, kv_len = flex.padded_length(n, CUDA), flex.padded_length(keys, CUDA)
        for window in (None, 7, 200):
            ours = flex.node_block_mask(call, window, q_len, kv_len, q_blocks=True)
            theirs = create_block_mask(ours.mask_mod, None, None, q_len, kv_len, device="cuda")
            mine, reference = block_sets(ours), block_sets(theirs)
            assert all(torch.equal(mine[name], reference[name]) for name in mine), (seed, window)


@pytest.mark.parametrize("mode", ["score", "train"])
@pytest.mark.parametrize("family", ["llama-hd16", "qwen2-hd16", "gemma2"])
def test_flex_exact_when_the_kernel_reads_the_block_lists(family, mode):
    """Llama and Qwen2 with head_dim 16 and rows of several 128-token blocks (full and partial blocks), and the tiny
    Gemma2 (head_dim 8, padded to 16; windows of 5 and none; softcaps)."""
    name = family.removesuffix("-hd16")
    model = build_model(name, hidden=64 if family.endswith("hd16") else 32).to(CUDA)
    batch = [t.to(CUDA) for t in make_batch(3, 3, prompt_len=150, completion_len=100, seed=7)]
    prompts, pmask, comps, cmask = batch
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    expected = parameter_grads(model, weighted_loss(dense))
    if mode == "score":
        with torch.no_grad():
            ours = compute_logps(model, prompts, comps, backend="flex", **kwargs)
    else:
        ours = compute_logps(model, prompts, comps, backend="flex", **kwargs)
        assert max_relative_grad_error(parameter_grads(model, weighted_loss(ours)), expected) <= FP32_GRAD_TOL
    assert (ours.logps.detach() - dense.logps.detach()).abs().max() <= FP32_LOGPS_TOL


def test_a_million_query_mask_builds_in_seconds_on_cuda(monkeypatch):
    prompts, prefix, generations, completion = 8, 4096, 16, 8192
    rows = prompts * generations
    prompts_call, call = (c.to(CUDA) for c in grouped_batch_calls(prompts, prefix, generations, completion))
    n = call.num_tokens
    built = {}

    def probe(query, key, value, block_mask, *args, **kwargs):
        built["mask"] = block_mask
        return query.transpose(1, 2)

    monkeypatch.setattr(flex, "_attend", probe)
    query = torch.zeros(1, 1, n, 1, device=CUDA)
    store = torch.zeros(1, prompts_call.num_tokens, 1, device=CUDA)
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        flex.node_attention(
            query, query, query, LayerCall(None, call, [(store, store)], {}, None, {}, needs_grad=False)
        )
    torch.cuda.synchronize()
    assert time.perf_counter() - start <= 10
    per_row = completion // 128
    assert int(built["mask"].kv_num_blocks.sum()) == rows * per_row
    assert int(built["mask"].full_kv_num_blocks.sum()) == rows * (
        per_row * prefix // 128 + per_row * (per_row - 1) // 2
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_dim_192_compiles_and_matches_dense_on_cuda(dtype):
    """A query/key head dim of 192 (MLA: DeepSeek-V3) through inductor's flex kernel, forward and backward, with the
    kernel options of backends/flex_kernel_options.py (torch's 256 configuration where its table lacks 192,
    IS_DIVISIBLE). bfloat16 within the dense bf16 path's own distance from a float32 truth."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=192,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=101,
    )
    torch.manual_seed(0)
    truth_model = transformers.LlamaForCausalLM(config).to(CUDA)
    model = transformers.LlamaForCausalLM(config).to(CUDA, dtype)
    truth_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    prompts, pmask, comps, cmask = (t.to(CUDA) for t in make_batch(2, 3, prompt_len=150, completion_len=100, seed=3))
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
    truth = compute_logps(truth_model, prompts, comps, backend="dense", **kwargs).logps.detach()
    ours = compute_logps(model, prompts, comps, backend="flex", **kwargs)
    ours.logps.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
    err = (ours.logps.detach() - truth)[cmask].abs().max()
    if dtype == torch.float32:
        assert err <= FP32_LOGPS_TOL, err
    else:
        from shared_prefix_logps.backends import sdpa_kernels

        with sdpa_kernels.excluded("CUDNN_ATTENTION"), torch.no_grad():
            dense = compute_logps(model, prompts, comps, backend="dense", **kwargs).logps
        assert err <= 2 * (dense - truth)[cmask].abs().max() + 1e-3, err
