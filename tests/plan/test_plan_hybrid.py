"""The planner on linear-attention hybrids (Qwen3.5, Qwen3-Next): parameters of the published sizes and of the tiny
test models equal to the built models', keys/values only in the attention layers, and each Gated DeltaNet layer's
state per prompt node (its recurrence state and convolution window, not growing with the prompt)."""

from __future__ import annotations

import pytest
import torch
from support.hybrid_models import HYBRID_FAMILIES, build_hybrid

from shared_prefix_logps.bench.presets import PRESETS, preset_config
from shared_prefix_logps.plan import Engine, Workload, load_dims, plan
from shared_prefix_logps.plan.dims import dims_from_config
from shared_prefix_logps.plan.flops import body_flops_per_token

HYBRID_PRESETS = ("qwen3.5-9b", "qwen3.5-35b-a3b", "qwen3-next-80b-a3b")


def _built_parameters(config) -> int:
    """sum(p.numel()) of the causal LM transformers builds from ``config``, on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", HYBRID_PRESETS)
def test_hybrid_presets_parameters_equal_the_built_model(name):
    """Exactly: Gated DeltaNet layers (projections, convolution, decays, gated norm), gated attention with QK-norms,
    routed and shared experts with their gates."""
    assert PRESETS[name].family in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
    assert load_dims(name).params == _built_parameters(preset_config(name))


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_tiny_hybrid_parameters_equal_the_built_model(family):
    model = build_hybrid(family)
    dims = load_dims(model.config.to_dict())
    assert dims.params == sum(p.numel() for p in model.parameters())
    assert (dims.linear_layers, dims.attention_layers) == (2, 1)


def test_published_layouts():
    """Three of every four layers Gated DeltaNet; ``--layers`` keeps the pattern of the first layers."""
    dims = load_dims("qwen3.5-9b")
    assert dims.linear.layers == tuple(i for i in range(32) if i % 4 != 3)
    assert (dims.linear_layers, dims.attention_layers) == (24, 8)
    assert dims.with_layers(4).linear.layers == (0, 1, 2) and dims.with_layers(4).attention_layers == 1
    next_dims = load_dims("qwen3-next-80b-a3b")
    assert (next_dims.attention_layers, next_dims.experts.count, next_dims.experts.per_token) == (12, 512, 10)
    assert next_dims.linear.state_bytes(2) == 4 * 32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3 * 2


def test_keys_values_only_in_attention_layers_and_a_state_per_prompt_node():
    dims = load_dims("qwen3.5-9b")
    workload = Workload(2, 1024, 256, 8, dtype="bf16")
    terms = plan(dims, workload, Engine(), ["chunked"])[0].memory.terms
    kv_per_token = dims.kv_heads * (dims.head_dim + dims.v_head_dim) * 2
    assert terms["prompt K/V grads"] == 2 * 1024 * kv_per_token * 8  # 8 attention layers of 32
    state = dims.linear.state_bytes(2) * 24
    assert terms["prompt recurrent states"] == terms["prompt recurrent state grads"] == 2 * state
    assert terms["row initial states"] == 2 * 2 * state  # one chunk of G // 4 generations of both prompts
    longer = plan(dims, Workload(2, 4096, 256, 8, dtype="bf16"), Engine(), ["chunked"])[0].memory.terms
    assert longer["prompt recurrent states"] == terms["prompt recurrent states"]  # the state does not grow
    assert longer["prompt K/V grads"] == 4 * terms["prompt K/V grads"]


def test_gated_deltanet_layers_cost_per_token_and_attend_over_no_pairs():
    """Only the attention layers' FLOPs grow with the prompt; the Gated DeltaNet layers' are per token (the body)."""
    dims = load_dims("qwen3.5-9b")
    attention_only = dims_from_config({**preset_config("qwen3.5-9b").to_dict(), "layer_types": ["full_attention"] * 32})
    assert attention_only.linear_layers == 0
    assert body_flops_per_token(dims) != body_flops_per_token(attention_only)
    short, long = (
        plan(dims, Workload(1, p, 64, 4, mode="score"), Engine(), ["expand"])[0].flops.parts for p in (512, 1024)
    )
    short_all, long_all = (
        plan(attention_only, Workload(1, p, 64, 4, mode="score"), Engine(), ["expand"])[0].flops.parts
        for p in (512, 1024)
    )
    assert (long["attention"] - short["attention"]) * 4 == long_all["attention"] - short_all["attention"]
