"""Head dimensions and flex_attention's CUDA kernel: heads below inductor's minimum of 16 are zero-padded (exact,
gradients included), and the kernel configurations torch picks for head dimensions 192 and 256 tile the flex
backend's 128-token blocks.

The compiled path runs on CPU here under a compile backend that refuses small heads exactly as inductor's CUDA
lowering does (``GraphCounter(cuda_rules=True)``), with flex's backward allowed on CPU (``compiled_on_cpu``).
"""

from __future__ import annotations

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.graph_counter import CUDA_FLEX_MIN_HEAD_DIM
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import compute_logps
from shared_prefix_logps.backends import flex
from shared_prefix_logps.backends.flex_blocks import BLOCK_SIZE

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_torch_thread"),
]


@pytest.mark.parametrize("family", ["gemma2", "qwen2"])
def test_small_heads_are_padded_to_the_kernel_minimum_exactly(family, compiled_on_cpu, monkeypatch):
    """The tiny models have head_dim 8, which inductor's CUDA flex kernel refuses; with CUDA's minimum applied on CPU
    the backend pads queries, keys and values to 16 and the log-probs and every gradient still match dense."""
    compiled_on_cpu.cuda_rules = True
    # (setattr, not setitem: a version of the backend without the attribute meets the rule and fails)
    cuda_minimum = getattr(flex, "MIN_HEAD_DIM", {}).get("cuda")
    monkeypatch.setattr(flex, "MIN_HEAD_DIM", {"cuda": cuda_minimum, "cpu": CUDA_FLEX_MIN_HEAD_DIM}, raising=False)
    seen = []
    call = flex._flex_call

    def spy(query, key, value, **kwargs):
        seen.append((query.shape[-1], key.shape[-1], value.shape[-1]))
        return call(query, key, value, **kwargs)

    monkeypatch.setattr(flex, "_flex_call", spy)
    model = build_model(family)
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert head_dim == 8
    prompts, pmask, comps, cmask = make_batch(3, 2, prompt_len=13, completion_len=8, seed=5)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    ours = compute_logps(model, prompts, comps, backend="flex", **kwargs)
    grads = parameter_grads(model, weighted_loss(ours))
    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    expected = parameter_grads(model, weighted_loss(dense))
    assert (ours.logps - dense.logps).abs().max() <= 1e-5
    assert (ours.entropy - dense.entropy).abs().max() <= 1e-5
    assert max_relative_grad_error(grads, expected) <= 1e-4
    assert seen and set(seen) == {(16, 16, 16)}, seen
    assert compiled_on_cpu.counts["flex"] >= 1  # the compiled path, under the CUDA rule, ran


def test_heads_at_or_above_the_minimum_are_not_padded(monkeypatch):
    query = torch.randn(1, 2, 5, 24)
    monkeypatch.setitem(flex.MIN_HEAD_DIM, "cpu", 16)
    assert all(t is query for t in flex._widen_heads(query, query, query))
    widened = flex._widen_heads(query[..., :8], query[..., :8], query[..., :12])
    assert [t.shape[-1] for t in widened] == [16, 16, 16]
    assert torch.equal(widened[2][..., :12], query[..., :12]) and not widened[2][..., 12:].any()


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0), (12, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 64, 128, 192, 256])
def test_kernel_configurations_tile_the_backend_blocks(capability, dtype, head_dim, monkeypatch):
    """torch's CUDA flex heuristics (torch/_inductor/template_heuristics/triton.py) give one default configuration
    per (capability, dtype, head_dim) without max-autotune; the lowering raises when BLOCK_M / BLOCK_N do not divide
    the BlockMask's block size (a lone configuration is not skipped). Head dims 192 and 256 (Gemma2 2B) included:
    192 is padded to 256 inside the kernel (QK_HEAD_DIM_ROUNDED) and has no table entry on sm90 (default 64 x 64,
    3 stages, 4 warps)."""
    heuristics = pytest.importorskip("torch._inductor.template_heuristics.triton")
    if not hasattr(heuristics, "CUDAConfigHeuristic"):
        pytest.skip("this torch has no CUDA flex heuristics class to read")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: capability)
    heuristic = heuristics.CUDAConfigHeuristic()
    forward = heuristic.get_flex_attn_fwd_configs(head_dim, dtype)
    backward = heuristic.get_flex_attn_bwd_configs(head_dim, dtype)
    assert forward and backward
    for config in forward:
        assert BLOCK_SIZE % config.block_m == 0 and BLOCK_SIZE % config.block_n == 0, config
    for config in backward:
        blocks = (config.block_m1, config.block_n1, config.block_m2, config.block_n2)
        assert all(BLOCK_SIZE % block == 0 for block in blocks), config
