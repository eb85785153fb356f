"""Tiny random causal LMs of each supported family, built from configs (nothing downloaded)."""

from __future__ import annotations

import torch

VOCAB = 101  # odd on purpose: nothing may assume a power of two

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "phi3")


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
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": 0.5},
        )
        cls = tf.Phi3ForCausalLM
    else:
        raise ValueError(f"unknown family {family!r}")
    torch.manual_seed(seed)
    model = cls(config).to(dtype)
    if family == "gemma2":
        # Attention softcapping needs the eager implementation (some transformers versions default to sdpa,
        # which ignores it).
        model.set_attn_implementation("eager")
    model.eval()
    return model


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
