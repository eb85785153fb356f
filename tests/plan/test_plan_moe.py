"""The planner's model sizes: every family's parameter count equals the model built from its config (mixture-of-experts
models with every expert, shared expert and router), FLOPs and activations count the routed experts per token, and
configs it cannot model are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from support.tiny_models import FAMILIES, MORE_FAMILIES, build_model

from shared_prefix_logps.cli import main
from shared_prefix_logps.plan import Engine, Workload, load_dims, plan
from shared_prefix_logps.plan.dims import dims_from_config
from shared_prefix_logps.plan.flops import body_flops_per_token

#: Real checkpoints' configs (the fields that size them), built on the meta device to count their parameters.
MOE_CONFIGS = {
    "mixtral-8x7b": dict(
        model_type="mixtral",
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=32000,
        num_local_experts=8,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
    ),
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe",
        hidden_size=2048,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=16,
        intermediate_size=5632,
        moe_intermediate_size=1408,
        shared_expert_intermediate_size=5632,
        num_experts=60,
        num_experts_per_tok=4,
        vocab_size=151936,
        tie_word_embeddings=False,
    ),
    "gpt-oss-20b": dict(
        model_type="gpt_oss",
        hidden_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=2880,
        num_local_experts=32,
        num_experts_per_tok=4,
        experts_per_token=4,
        vocab_size=201088,
        attention_bias=True,
        sliding_window=128,
        tie_word_embeddings=False,
    ),
    "glm-4.5-air": dict(
        model_type="glm4_moe",
        hidden_size=4096,
        num_hidden_layers=46,
        num_attention_heads=96,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        n_routed_experts=128,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=1,
        vocab_size=151552,
        attention_bias=True,
        partial_rotary_factor=0.5,
        tie_word_embeddings=False,
    ),
    "deepseek-v3": dict(
        model_type="deepseek_v3",
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        num_key_value_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        first_k_dense_replace=3,
        n_group=8,
        topk_group=4,
        vocab_size=129280,
        tie_word_embeddings=False,
    ),
}


def _built_parameters(fields: dict) -> int:
    """sum(p.numel()) of the causal LM transformers builds from ``fields``, on the meta device (no memory)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    fields = dict(fields)
    config = CONFIG_MAPPING[fields.pop("model_type")](**fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_moe_checkpoint_parameters_equal_the_built_model(name):
    built = _built_parameters(MOE_CONFIGS[name])
    planned = dims_from_config(MOE_CONFIGS[name], name=name).params
    assert abs(planned / built - 1) < 0.01, (name, planned, built)


@pytest.mark.parametrize("family", FAMILIES + MORE_FAMILIES)
def test_every_family_parameters_equal_the_built_model(family):
    """The tiny test models of every supported family (MoE ones with routers, shared experts and their gates, GPT-OSS
    with expert biases and sinks, DeepSeek-V3 with latent attention), from the config the model was built with."""
    model = build_model(family)
    built = sum(p.numel() for p in model.parameters())
    planned = load_dims(model.config.to_dict()).params
    assert abs(planned / built - 1) < 0.01, (family, planned, built)


def test_moe_flops_and_activations_count_the_routed_experts():
    """A token goes through its top-k experts (and the shared ones), not through every expert: per token the body
    costs what a dense model of k experts' width costs, plus the router."""
    mixtral = dims_from_config(MOE_CONFIGS["mixtral-8x7b"])
    as_dense = dims_from_config({**MOE_CONFIGS["mixtral-8x7b"], "num_local_experts": 0, "intermediate_size": 2 * 14336})
    assert body_flops_per_token(mixtral) == body_flops_per_token(as_dense) + 2 * 4096 * 8
    deepseek = dims_from_config(MOE_CONFIGS["deepseek-v3"])
    # 3 dense layers of 18432, 58 MoE layers of 8 routed + 1 shared experts of 2048.
    assert deepseek.mlp_width == (3 * 18432 + 58 * 9 * 2048) / 61
    workload = Workload(1, 1024, 256, 8)
    terms = plan(mixtral, workload, methods=["chunked"])[0].memory.terms
    dense_terms = plan(as_dense, workload, methods=["chunked"])[0].memory.terms
    assert terms["prompt activations"] > dense_terms["prompt activations"]  # the routing copies and router logits
    assert terms["prompt activations"] < 1.2 * dense_terms["prompt activations"]


def test_moe_model_state_counts_every_expert_and_does_not_fit_one_gpu():
    """Qwen3-30B-A3B trained with AdamW in bf16: parameters, gradients and optimizer states of all 30.5B parameters
    (about 341 GiB) do not fit one 80 GB device."""
    workload = Workload(2, 1024, 512, 8)
    result = plan(MOE_CONFIGS["qwen3-30b-a3b"], workload, Engine(memory_bytes=80 * 10**9), ["chunked"])[0]
    state = sum(result.memory.terms[name] for name in ("parameters", "gradients", "optimizer states"))
    assert state == 30_532_122_624 * (2 + 2 + 8)
    assert result.fits is False


def test_layers_override_keeps_the_routed_layers():
    """``--layers N`` keeps the first N layers, routed where the full model's are (DeepSeek-V3: three dense first)."""
    deepseek = load_dims(MOE_CONFIGS["deepseek-v3"])
    assert deepseek.with_layers(2).moe_layers == 0
    assert deepseek.with_layers(5).moe_layers == 2
    built = _built_parameters({**MOE_CONFIGS["deepseek-v3"], "num_hidden_layers": 5})
    assert abs(deepseek.with_layers(5).params / built - 1) < 0.01


@pytest.mark.parametrize(
    "config, named",
    [
        ({"model_type": "olmoe", "num_experts": 64, "num_experts_per_tok": 8}, "olmoe"),
        ({"model_type": "my_moe", "n_routed_experts": 16, "num_experts_per_tok": 2}, "my_moe"),
        ({"model_type": "lfm2", "layer_types": ["conv", "full_attention"]}, "conv"),
        ({"model_type": "kimi_linear", "layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
        # a Gated DeltaNet hybrid is planned, from its linear-attention sizes
        ({"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"]}, "linear_num_key_heads"),
    ],
)
def test_configs_plan_cannot_model_are_refused_by_name(config, named):
    base = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=100)
    with pytest.raises(ValueError, match=named):
        load_dims({**base, **config})


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_attention_heads", 0),
        ("hidden_size", "4096"),
        ("hidden_size", 4096.5),
        ("num_key_value_heads", -2),
        ("vocab_size", True),
        ("num_experts_per_tok", "two"),
    ],
)
def test_bad_config_fields_are_named(field, value, tmp_path):
    config = {**MOE_CONFIGS["mixtral-8x7b"], field: value}
    with pytest.raises(ValueError, match=f"field '{field}'"):
        load_dims(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = ["plan", "--model", str(path), "--prompt-len", "64", "--completion-len", "32", "--generations", "4"]
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert str(raised.value).startswith(f"shared-prefix-logps plan: --model: config '{path}': field '{field}'")
