"""Tiny random models of the recurrent families of the installed transformers, for the family verdicts
(shared_prefix_logps.recurrent.families): each config class's defaults with its sizes shrunk, plus what a family
needs to build small (layer patterns that keep a recurrent and an attention layer, head sizes that divide)."""

from __future__ import annotations

import inspect

import torch
from transformers import AutoConfig, AutoModelForCausalLM

#: Size settings, each applied where the family's config class takes it.
_SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=101,
    max_position_embeddings=256,
    initializer_range=0.02,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_d_state=8,
    mamba_n_groups=1,
    mamba_expand=2,
    mamba_d_conv=4,
    mamba_chunk_size=16,
    ssm_state_size=8,
    state_size=8,
    n_groups=1,
    expand=2,
    conv_kernel=4,
    mamba_num_heads=4,
    mamba_head_dim=8,
    chunk_size=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    n_routed_experts=4,
    num_local_experts=4,
    time_step_rank=4,
    conv_L_cache=3,
    mamba_dt_rank=4,
    hidden_act="silu",
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

_FAMILY = {
    "nemotron_h": dict(hybrid_override_pattern="M*M-", mamba_d_head=8),
    "granitemoehybrid": dict(layer_types=["mamba", "attention", "mamba", "attention"]),
    "bamba": dict(attn_layer_indices=[1]),
    "falcon_h1": dict(mamba_d_ssm=64),
    "mamba2": dict(num_heads=8, head_dim=8),
    "zamba2": dict(layers_block_type=["mamba", "hybrid", "mamba", "mamba"], mamba_headdim=8, n_mamba_heads=8),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "zamba": dict(attn_layer_period=2, attn_layer_offset=1, tie_word_embeddings=False),
    "kimi_linear": dict(
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_head_dim=8,
        linear_num_heads=4,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
        kv_lora_rank=8,
        q_lora_rank=None,
        num_key_value_heads=4,
    ),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "recurrent_gemma": dict(
        block_types=["recurrent", "attention"],
        num_hidden_layers=2,
        lru_width=32,
        attention_window_size=64,
        num_key_value_heads=1,
    ),
}


def tiny_family_model(model_type: str, seed: int = 0):
    """A tiny float32 causal LM of ``model_type`` in eval mode."""
    config_class = type(AutoConfig.for_model(model_type))
    accepted = set(inspect.signature(config_class.__init__).parameters)
    accepted |= set(getattr(config_class, "__dataclass_fields__", {})) | set(
        getattr(config_class, "__annotations__", {})
    )
    kwargs = {key: value for key, value in _SMALL.items() if key in accepted}
    kwargs.update(_FAMILY.get(model_type, {}))
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config_class(**kwargs)).float().eval()
