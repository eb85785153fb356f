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

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


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


# ---- inductor's CUDA configuration choice, emulated (torch's own heuristics, sm90) ----------------------------------


@pytest.fixture
def cuda_kernel_options(monkeypatch):
    """The kernel options a CUDA call on an sm90 GPU gets, given to CPU calls; the configuration cache emptied."""
    from shared_prefix_logps.backends import flex_kernel_options

    monkeypatch.setattr(flex_kernel_options, "DEVICES", flex_kernel_options.DEVICES | {"cpu"})
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args: (9, 0))
    flex_kernel_options.forward_blocks.cache_clear()
    yield flex_kernel_options
    flex_kernel_options.forward_blocks.cache_clear()


def _llama_with_head_dim(head_dim, dtype):
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        intermediate_size=32,
        num_hidden_layers=2,
        vocab_size=101,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype)


def test_head_dim_192_compiles_where_torchs_sm90_table_lacks_it(compiled_on_cpu, cuda_kernel_options):
    """MLA's query/key head dim 192 (DeepSeek-V3): torch's sm90 table has no bfloat16 entry for it (2.11 and 2.13),
    and its default at the 256-wide tiles the kernel rounds 192 up to does not fit an H100 block's shared memory. The
    backend passes the configuration torch gives 256 on that GPU; every length padded to 128 is declared divisible."""
    from support.graph_counter import torch_forward_config

    compiled_on_cpu.cuda_rules = True
    model = _llama_with_head_dim(192, torch.bfloat16)
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=13, completion_len=8, seed=2)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
    with torch.no_grad():
        ours = compute_logps(model, prompts, comps, backend="flex", **kwargs)
        dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    assert (ours.logps - dense.logps).abs().max() <= 0.05  # bfloat16 on both sides
    assert compiled_on_cpu.counts["flex"] >= 1 and compiled_on_cpu.configs
    tuned_256 = torch_forward_config((9, 0), torch.bfloat16, 256)
    assert all(c["head_dim"] == 192 and c["untabled"] and c["config"] == tuned_256 for c in compiled_on_cpu.configs)
    assert compiled_on_cpu.divisible and all(compiled_on_cpu.divisible)


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_padded_lengths_run_the_kernel_without_bounds_checks(family, compiled_on_cpu, cuda_kernel_options, monkeypatch):
    """Dynamic lengths prove nothing to inductor, which then bounds-checks every tile (IS_DIVISIBLE=False), though
    every length the backend hands the kernel is a whole number of 128-token blocks: both node calls say so."""
    compiled_on_cpu.cuda_rules = True
    monkeypatch.setitem(flex.MIN_HEAD_DIM, "cpu", CUDA_FLEX_MIN_HEAD_DIM)  # head dim 8, widened to 16 as on CUDA
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=13, completion_len=8, seed=4)
    with torch.no_grad():
        compute_logps(model, prompts, comps, backend="flex", prompt_mask=pmask, completion_mask=cmask)
    assert compiled_on_cpu.divisible and all(compiled_on_cpu.divisible)  # one graph serves both node calls


@pytest.mark.parametrize("torch_2_11_table", [False, True])
@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 96, 128, 160, 192, 256])
def test_forward_configuration_is_torchs_unless_its_table_lacks_a_wide_head(
    capability, dtype, head_dim, torch_2_11_table, cuda_kernel_options, monkeypatch
):
    """Torch's entry wherever it has one; the rounded head dim's entry for one it lacks above 128 (torch 2.13's
    table as installed, and with the 192 entries torch 2.11 does not have removed)."""
    heuristics = pytest.importorskip("torch._inductor.template_heuristics.triton")
    from support.graph_counter import torch_forward_config

    if torch_2_11_table:  # 2.11: no (float32, 192) on sm90, no 192 on sm80; sm100's 192 entries are in both
        init = heuristics.CUDAConfigHeuristic.__init__

        def init_2_11(self):
            init(self)
            for table in (self.h100_default_flex_config, self.a100_default_flex_config):
                for key in [key for key in table if key[1] == 192]:
                    del table[key]

        monkeypatch.setattr(heuristics.CUDAConfigHeuristic, "__init__", init_2_11)
    options = cuda_kernel_options.forward_blocks(capability, dtype, head_dim)
    own = torch_forward_config(capability, dtype, head_dim)
    odd = torch_forward_config(capability, dtype, head_dim - 1)  # no table has an odd head dim
    if head_dim in (160, 192) and own == odd:
        tuned = torch_forward_config(capability, dtype, 256)
        expected = {} if tuned == own else dict(zip(("BLOCK_M", "BLOCK_N", "num_stages", "num_warps"), tuned))
        assert {key.removeprefix("fwd_"): value for key, value in options.items()} == expected
    else:
        assert options == {}
    if (capability, dtype, head_dim) == ((9, 0), torch.bfloat16, 192):
        assert options == {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 32, "fwd_num_stages": 3, "fwd_num_warps": 4}
