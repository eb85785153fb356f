"""The planner reads the configs transformers itself writes for every family it lists: ``Config().to_dict()``, a
``save_pretrained`` folder and its ``config.json``, each counted exactly against the model transformers builds from
that config (tiny sizes); Qwen3.5-MoE's configs, which have no ``intermediate_size`` (every layer is routed), among
them. Malformed mixture-of-experts and hybrid fields are refused with errors that name the field."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from shared_prefix_logps.bench.flops import ModelShape
from shared_prefix_logps.bench.presets import PRESETS, preset_config
from shared_prefix_logps.cli import main
from shared_prefix_logps.model.discovery import SUPPORTED_MODEL_TYPES
from shared_prefix_logps.plan import load_dims
from shared_prefix_logps.plan.dims import LINEAR_ATTENTION_MODEL_TYPES, MOE_MODEL_TYPES

#: Every model type the planner names (its mixture-of-experts and hybrid layouts) and every family the library
#: serves.
PLANNED_TYPES = sorted(set(MOE_MODEL_TYPES) | set(LINEAR_ATTENTION_MODEL_TYPES) | set(SUPPORTED_MODEL_TYPES))

#: Tiny sizes, each applied where the family's config has the field: 4 layers (a hybrid's default pattern then holds
#: three Gated DeltaNet layers and one attention layer), grouped query heads, 4 experts of which 2 per token, one
#: first dense layer where a family has that field, grouped value heads in the Gated DeltaNet layers.
TINY = dict(
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    vocab_size=101,
    pad_token_id=None,
    max_position_embeddings=256,
    sliding_window=16,
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    experts_per_token=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)


def _tiny_config(model_type: str):
    """The family's config class with :data:`TINY`'s sizes where it has those fields (a composite config's in its
    ``text_config``); every other field as transformers defaults it."""
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    if isinstance(defaults.get("text_config"), dict):
        return config_class(text_config={k: v for k, v in TINY.items() if k in defaults["text_config"]})
    return config_class(**{k: v for k, v in TINY.items() if k in defaults})


def _built_parameters(config) -> int:
    """sum(p.numel()) of the causal LM transformers builds from ``config``, on the meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("model_type", PLANNED_TYPES)
def test_configs_transformers_writes_are_counted_exactly(model_type, tmp_path):
    config = _tiny_config(model_type)
    built = _built_parameters(config)
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == model_type
    for source in (config.to_dict(), tmp_path, tmp_path / "config.json", str(tmp_path / "config.json")):
        assert load_dims(source).params == built, (model_type, source)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_5_moe"])
def test_qwen3_5_moe_configs_have_no_dense_width_and_route_every_layer(model_type, tmp_path, capsys):
    """The text config and the composite (vision + text) config at transformers' defaults, which are the published
    Qwen3.5-35B-A3B sizes: no ``intermediate_size`` anywhere, every layer routed; the parameters equal the built
    causal LM's (on the meta device), and ``plan --model`` reads the ``save_pretrained`` folder."""
    config = CONFIG_MAPPING[model_type]()
    written = config.to_dict()
    assert "intermediate_size" not in written and "intermediate_size" not in written.get("text_config", {})
    dims = load_dims(written)
    assert dims.intermediate == 0 and dims.moe_layers == dims.layers == 40
    assert (dims.experts.count, dims.experts.per_token, dims.experts.shared_intermediate) == (256, 8, 512)
    assert dims.params == _built_parameters(config)
    config.save_pretrained(tmp_path)
    argv = ["plan", "--model", str(tmp_path), "--prompt-len", "1024", "--completion-len", "256", "--generations", "8"]
    assert main([*argv, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["methods"]
    assert {record["method"] for record in planned} >= {"dense", "chunked"}
    assert all(record["breakdown"]["parameters"] == dims.params * 2 for record in planned)  # bf16


def test_qwen3_5_moe_preset_has_no_made_up_dense_width():
    """The preset builds the config transformers writes for the family (no ``intermediate_size``), its parameters are
    the built model's, and bench's FLOP model reads it."""
    assert PRESETS["qwen3.5-35b-a3b"].mlp is None
    config = preset_config("qwen3.5-35b-a3b")
    assert "intermediate_size" not in config.to_dict()
    dims = load_dims("qwen3.5-35b-a3b")
    assert dims.intermediate == 0 and dims.params == _built_parameters(config)
    shape = ModelShape.from_config(preset_config("qwen3.5-35b-a3b", layers=4))
    assert shape.routed == ((8 * 512 + 512, 256),) * 4


def _tiny_fields(model_type: str) -> dict:
    return _tiny_config(model_type).to_dict()


@pytest.mark.parametrize(
    "model_type, change, field",
    [
        # more experts per token than experts
        ("qwen3_5_moe_text", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ("gpt_oss", {"num_experts_per_tok": None, "experts_per_token": 9}, "experts_per_token"),
        ("qwen3_next", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
        # a family whose every layer is routed needs its experts
        ("qwen3_5_moe_text", {"num_experts": 0}, "num_experts"),
        ("qwen3_5_moe_text", {"moe_intermediate_size": 0}, "moe_intermediate_size"),
        ("qwen3_moe", {"moe_intermediate_size": None}, "moe_intermediate_size"),
        ("mixtral", {"intermediate_size": None}, "intermediate_size"),
        # a dense layer needs the dense width
        ("qwen3_next", {"intermediate_size": None, "mlp_only_layers": [1]}, "intermediate_size"),
        ("llama", {"intermediate_size": None}, "intermediate_size"),
        # layer patterns: one kind per layer, indices inside the model
        ("qwen3_5_moe_text", {"layer_types": ["linear_attention", "full_attention"]}, "layer_types"),
        ("qwen3_next", {"layer_types": ["linear_attention"] * 3 + ["full_attention"] * 2}, "layer_types"),
        ("qwen3_5_text", {"layer_types": "full_attention"}, "layer_types"),
        ("gemma3_text", {"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ("qwen3_moe", {"mlp_only_layers": [4]}, "mlp_only_layers"),
        ("qwen2_moe", {"mlp_only_layers": [-1]}, "mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("deepseek_v3", {"first_k_dense_replace": 5}, "first_k_dense_replace"),
        # expert groups of the DeepSeek-V3 / GLM-4.5 routers
        ("deepseek_v3", {"n_group": 3}, "n_group"),
        ("glm4_moe", {"n_group": 2, "topk_group": 3}, "topk_group"),
        ("deepseek_v3", {"n_group": 2, "topk_group": 1, "num_experts_per_tok": 3}, "num_experts_per_tok"),
        ("deepseek_v3", {"n_shared_experts": -1}, "n_shared_experts"),
        # Gated DeltaNet sizes
        ("qwen3_5_text", {"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ("qwen3_5_moe_text", {"linear_num_key_heads": 0}, "linear_num_key_heads"),
        ("qwen3_next", {"linear_key_head_dim": 8.5}, "linear_key_head_dim"),
        ("qwen3_5_text", {"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
        ("qwen3_5_moe_text", {"shared_expert_intermediate_size": -1}, "shared_expert_intermediate_size"),
    ],
)
def test_bad_moe_and_hybrid_fields_are_refused_by_name(model_type, change, field, tmp_path):
    config = {**_tiny_fields(model_type), **change}
    with pytest.raises(ValueError, match=f"'{field}'|{field}:| {field}[ :]"):
        load_dims(config)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = ["plan", "--model", str(path), "--prompt-len", "64", "--completion-len", "32", "--generations", "4"]
    with pytest.raises(SystemExit) as raised:
        main(argv)
    assert field in str(raised.value) and str(raised.value).startswith("shared-prefix-logps plan: --model:")
