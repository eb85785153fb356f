"""Models of the GPU tests (tests/gpu/), built from configs on CPU; the tests move them to CUDA.

Every model here has head_dim >= 16: inductor's CUDA lowering of flex_attention refuses smaller heads ("NYI:
embedding dimension of the query, key, and value must be at least 16"), so the tiny CPU models (head_dim 8) cannot
run the flex backend on a GPU.
"""

from __future__ import annotations

import torch
import transformers

from .tiny_models import VOCAB, build_model

#: The smallest head size inductor's CUDA flex lowering takes.
MIN_FLEX_HEAD_DIM = 16

#: Families :func:`gpu_test_model` builds.
GPU_FAMILIES = ("llama", "qwen2", "gemma2", "gemma2-hd256")


def gpu_test_model(family: str, dtype=torch.float32, seed: int = 0) -> torch.nn.Module:
    """A 2-layer model of ``family`` with head_dim 16 (256 for ``gemma2-hd256``) and grouped-query attention.

    - ``llama``, ``qwen2``: the tiny models of tests/support/tiny_models.py at hidden size 64 (4 heads of 16 over 2
      KV heads; Qwen2 with attention biases and tied embeddings).
    - ``gemma2``: sliding window 5 (shorter than the test rows), attention softcap 5 and final softcap 3.
    - ``gemma2-hd256``: Gemma-2's real head size 256, a sliding (16 tokens) and a global layer, softcaps 50 and 30.
    """
    if family in ("llama", "qwen2"):
        return build_model(family, dtype=dtype, seed=seed, hidden=64)
    if family == "gemma2":
        config = transformers.Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=5,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            max_position_embeddings=512,
            initializer_range=0.1,
            tie_word_embeddings=True,
        )
    elif family == "gemma2-hd256":
        config = transformers.Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=128,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=16,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            max_position_embeddings=512,
            initializer_range=0.05,
            tie_word_embeddings=True,
        )
    else:
        raise ValueError(f"unknown GPU test family {family!r}; one of {GPU_FAMILIES}")
    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(config).to(dtype)
    model.set_attn_implementation("eager")  # the dense reference must apply the attention softcap
    return model.eval()


def head_dim(model: torch.nn.Module) -> int:
    config = model.config
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


#: The peak-memory model: 8 layers, 4 query heads per KV head (head_dim 32), a real vocabulary.
PEAK_VOCAB = 151936


def peak_memory_config() -> transformers.Qwen2Config:
    """The peak-memory model's config: a Qwen2 of 8 layers, hidden 256, 8 query heads over 2 KV heads of 32,
    vocabulary 151,936, tied embeddings: deep enough that per-layer copies add up, grouped enough that a repeat of
    the KV heads shows."""
    return transformers.Qwen2Config(
        vocab_size=PEAK_VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    )


def peak_memory_model(dtype=torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """The model of :func:`peak_memory_config` with random weights."""
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(peak_memory_config()).to(dtype)
