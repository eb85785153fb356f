"""Tiny random causal LMs of each supported family, built from configs (nothing downloaded)."""

from __future__ import annotations

import torch
import transformers

#: transformers 5 moved every RoPE setting into ``config.rope_parameters``; 4.x configs take ``rope_theta``,
#: ``partial_rotary_factor`` and ``rope_scaling`` (and Gemma3 ``rope_local_base_freq``) and silently keep an unknown
#: ``rope_parameters`` kwarg as a plain attribute, so the tests below would lose their RoPE variants unnoticed.
TRANSFORMERS_4 = int(transformers.__version__.split(".")[0]) < 5

#: Families whose modeling code does not route attention through ``AttentionInterface`` in the installed
#: transformers (the library refuses them there with UnsupportedModelError), with the reason.
NOT_ROUTED = {"qwen2_moe": "Qwen2-MoE routes attention through AttentionInterface from transformers 5.0 on"}
NOT_ROUTED = NOT_ROUTED if TRANSFORMERS_4 else {}

VOCAB = 101  # odd on purpose: nothing may assume a power of two

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3")

#: Families added later, tested in their own module (tests/models/test_model_families.py) so that the long parametrized
#: tests over FAMILIES keep their runtime.
MORE_FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "gpt_oss",
    "gemma3_text",
    "olmo2",
    "cohere",
    "cohere2",
    "glm4",
    "glm4_moe",
    "granite",
    "deepseek_v3",
)


def rope_kwargs(parameters: dict) -> dict:
    """Config kwargs that set RoPE ``parameters`` (transformers 5 ``rope_parameters``, possibly one dict per layer
    type) in the installed transformers' terms."""
    if not TRANSFORMERS_4:
        return {"rope_parameters": parameters}
    if "full_attention" in parameters:  # Gemma3: global layers as rope_theta/rope_scaling, local ones by base only
        local = parameters["sliding_attention"]
        assert set(local) <= {"rope_type", "rope_theta"} and local.get("rope_type", "default") == "default", local
        return {**rope_kwargs(parameters["full_attention"]), "rope_local_base_freq": local["rope_theta"]}
    scaling = dict(parameters)
    kwargs = {"rope_theta": scaling.pop("rope_theta")}
    if "partial_rotary_factor" in scaling:
        kwargs["partial_rotary_factor"] = scaling.pop("partial_rotary_factor")
    kind = scaling.get("rope_type", "default")
    if kind == "longrope":
        # 4.x Phi3 takes exactly these three fields and the original length from the config's own attribute.
        scaling = {"type": kind, "short_factor": scaling["short_factor"], "long_factor": scaling["long_factor"]}
    kwargs["rope_scaling"] = None if kind == "default" else scaling
    return kwargs


def build_model(
    family: str, *, tied: bool | None = None, dtype=torch.float32, seed: int = 0, layers: int = 2, hidden: int = 32
):
    """A 2-layer model of ``family`` with grouped-query attention and features that stress the shared path:
    Mistral and Gemma2 get sliding windows shorter than the test sequences, Gemma2 its attention and final
    softcaps, Phi3 partial rotary embeddings, Qwen2 attention biases and tied embeddings."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.1,
    )
    if family == "llama":
        config = tf.LlamaConfig(**common, tie_word_embeddings=bool(tied))
        cls = tf.LlamaForCausalLM
    elif family == "qwen2":
        config = tf.Qwen2Config(**common, tie_word_embeddings=True if tied is None else tied)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=8, tie_word_embeddings=bool(tied))
        cls = tf.Qwen3ForCausalLM
    elif family == "mistral":
        config = tf.MistralConfig(**common, head_dim=8, sliding_window=6, tie_word_embeddings=bool(tied))
        cls = tf.MistralForCausalLM
    elif family == "gemma2":
        config = tf.Gemma2Config(
            **common,
            head_dim=8,
            query_pre_attn_scalar=12,
            sliding_window=5,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            tie_word_embeddings=True if tied is None else tied,
        )
        cls = tf.Gemma2ForCausalLM
    elif family == "phi3":
        config = tf.Phi3Config(
            **common,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,  # Phi3's defaults (32000) lie outside the tiny vocabulary
            tie_word_embeddings=bool(tied),
            **rope_kwargs({"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5}),
        )
        cls = tf.Phi3ForCausalLM
    elif family in MORE_FAMILIES:
        config, cls = _more_family_config(family, common, tied)
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    if family == "gpt_oss":
        # Sinks of a few nats, so each head's sink takes a visible share of the softmax mass.
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
    if family == "gemma2":
        # Attention softcapping needs the eager implementation (some transformers versions default to sdpa,
        # which ignores it).
        model.set_attn_implementation("eager")
    model.eval()
    return model


def _more_family_config(family: str, common: dict, tied: bool | None):
    """(config, model class) of the families in :data:`MORE_FAMILIES`; each stresses what sets the family apart.

    - MoE families: 4 routed experts, 2 per token (DeepSeek-V3 and GLM4-MoE with group-limited routing and a shared
      expert, Qwen2-MoE with its gated shared expert), so routing differences between the paths would show.
    - GPT-OSS: attention sinks (randomized in :func:`build_model`), alternating sliding/full layers, YaRN RoPE.
    - Gemma3: sliding and full layers with their own RoPE bases (linear scaling on the full ones),
      ``query_pre_attn_scalar``, QK-norm, scaled embeddings.
    - Mixtral, Qwen2-MoE, Cohere2: sliding windows shorter than the test sequences.
    - OLMo2, Qwen3-MoE, GLM4-MoE, Cohere: QK-norm (OLMo2 over the whole projection, Cohere per head LayerNorm).
    - Cohere/Cohere2: ``logit_scale``, parallel attention/MLP blocks, interleaved RoPE; Granite: ``logits_scaling``
      and embedding/residual/attention multipliers; GLM4: partial RoPE, attention bias, post-norms.
    - DeepSeek-V3: multi-head latent attention with q/kv LoRA ranks, key head dim (12) != value head dim (6), and
      YaRN RoPE whose mscale also rescales the attention scores.
    """
    import transformers as tf

    moe = dict(num_experts_per_tok=2, moe_intermediate_size=16)
    if family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **common, **moe, head_dim=8, num_experts=4, norm_topk_prob=True, tie_word_embeddings=bool(tied)
        )
        return config, tf.Qwen3MoeForCausalLM
    if family == "qwen2_moe":
        config = tf.Qwen2MoeConfig(
            **common,
            **moe,
            num_experts=4,
            shared_expert_intermediate_size=24,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,  # layer 0 slides, layer 1 attends to everything
            tie_word_embeddings=bool(tied),
        )
        return config, tf.Qwen2MoeForCausalLM
    if family == "mixtral":
        config = tf.MixtralConfig(
            **common,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=6,
            tie_word_embeddings=bool(tied),
        )
        return config, tf.MixtralForCausalLM
    if family == "gpt_oss":
        config = tf.GptOssConfig(
            **common,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            **rope_kwargs(
                {
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 4.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 64,
                }
            ),
            tie_word_embeddings=bool(tied),
        )
        return config, tf.GptOssForCausalLM
    if family == "gemma3_text":
        config = tf.Gemma3TextConfig(
            **common,
            head_dim=8,
            query_pre_attn_scalar=12,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],
            **rope_kwargs(
                {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                }
            ),
            tie_word_embeddings=True if tied is None else tied,
        )
        return config, tf.Gemma3ForCausalLM
    if family == "olmo2":
        config = tf.Olmo2Config(**common, pad_token_id=0, eos_token_id=2, tie_word_embeddings=bool(tied))
        return config, tf.Olmo2ForCausalLM
    if family == "cohere":
        config = tf.CohereConfig(
            **common,
            logit_scale=0.25,
            use_qk_norm=True,
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=True if tied is None else tied,
        )
        return config, tf.CohereForCausalLM
    if family == "cohere2":
        config = tf.Cohere2Config(
            **common,
            logit_scale=0.25,
            sliding_window=5,
            layer_types=["sliding_attention", "full_attention"],  # the full layer has no RoPE
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=True if tied is None else tied,
        )
        return config, tf.Cohere2ForCausalLM
    if family == "glm4":
        config = tf.Glm4Config(**common, head_dim=8, pad_token_id=0, tie_word_embeddings=bool(tied))
        return config, tf.Glm4ForCausalLM
    if family == "glm4_moe":
        config = tf.Glm4MoeConfig(
            **common,
            **moe,
            head_dim=8,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
            use_qk_norm=True,
            tie_word_embeddings=bool(tied),
        )
        return config, tf.Glm4MoeForCausalLM
    if family == "granite":
        config = tf.GraniteConfig(
            **common,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.3,
            logits_scaling=4.0,
            tie_word_embeddings=bool(tied),
        )
        return config, tf.GraniteForCausalLM
    if family == "deepseek_v3":
        config = tf.DeepseekV3Config(
            **{**common, "num_key_value_heads": 4},  # MLA expands its latent to every head
            **moe,
            q_lora_rank=16,
            kv_lora_rank=12,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
            first_k_dense_replace=1,
            # YaRN with mscale_all_dim, as the released checkpoints: it also rescales the attention scores
            **rope_kwargs(
                {
                    "rope_type": "yarn",
                    "rope_theta": 10000.0,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "mscale": 1.0,
                    "mscale_all_dim": 1.0,
                }
            ),
            tie_word_embeddings=bool(tied),
        )
        return config, tf.DeepseekV3ForCausalLM
    raise ValueError(f"unknown family {family!r}")


def make_batch(num_prompts: int, generations: int, prompt_len: int, completion_len: int, *, seed: int = 0):
    """Left-padded prompts of different true lengths (one of a single token) and right-padded completions of
    different lengths (one empty when there are enough rows).

    Returns (prompts (B, P), prompt_mask, completions (B*G, C), completion_mask); padded ids are 0.
    """
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (num_prompts, prompt_len), generator=gen)
    lengths = torch.randint(1, prompt_len + 1, (num_prompts,), generator=gen)
    lengths[0] = prompt_len
    if num_prompts > 1:
        lengths[1] = 1
    prompt_mask = torch.arange(prompt_len)[None, :] >= (prompt_len - lengths)[:, None]
    prompts = prompts.masked_fill(~prompt_mask, 0)
    rows = num_prompts * generations
    completions = torch.randint(0, VOCAB, (rows, completion_len), generator=gen)
    comp_lengths = torch.randint(1, completion_len + 1, (rows,), generator=gen)
    comp_lengths[0] = completion_len
    if rows > 2:
        comp_lengths[2] = 0
    completion_mask = torch.arange(completion_len)[None, :] < comp_lengths[:, None]
    completions = completions.masked_fill(~completion_mask, 0)
    return prompts, prompt_mask, completions, completion_mask


def randomize_lora(model, std: float = 0.2):
    """Give a PEFT model's LoRA B matrices non-zero values (PEFT starts them at zero), so the adapter changes the
    numbers and every adapter gradient is non-trivial."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, std)
    return model
