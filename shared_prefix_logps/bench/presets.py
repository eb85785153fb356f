"""Model presets built from configs with random weights (nothing is downloaded).

The named presets mirror the shapes of real checkpoints (DESIGN.md); ``tiny`` is a small Qwen2-style model that
runs anywhere in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Preset:
    """Shape of a decoder-only model; see :func:`build_preset`."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    vocab: int
    tied: bool
    extra: tuple = ()


PRESETS = {
    "tiny": Preset("qwen2", 256, 4, 8, 2, 32, 688, 8192, True),
    "qwen2.5-0.5b": Preset("qwen2", 896, 24, 14, 2, 64, 4864, 151936, True),
    "qwen2.5-1.5b": Preset("qwen2", 1536, 28, 12, 2, 128, 8960, 151936, True),
    "qwen2.5-7b": Preset("qwen2", 3584, 28, 28, 4, 128, 18944, 152064, False),
    "qwen3-4b": Preset("qwen3", 2560, 36, 32, 8, 128, 9728, 151936, True),
    "qwen3-8b": Preset("qwen3", 4096, 36, 32, 8, 128, 12288, 151936, False),
    "llama-3.1-8b": Preset("llama", 4096, 32, 32, 8, 128, 14336, 128256, False),
    "gemma-2-2b": Preset(
        "gemma2",
        2304,
        26,
        8,
        4,
        256,
        9216,
        256000,
        True,
        (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("sliding_window", 4096)),
    ),
}


_FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
}


def preset_config(name: str, *, layers=None):
    """The transformers config of preset ``name`` (``layers`` overrides the depth); no weights are made."""
    import transformers as tf

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[name]
    config_cls = getattr(tf, _FAMILIES[p.family][0])
    return config_cls(
        vocab_size=p.vocab,
        hidden_size=p.hidden,
        intermediate_size=p.mlp,
        num_hidden_layers=layers or p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        head_dim=p.head_dim,
        tie_word_embeddings=p.tied,
        max_position_embeddings=131072,
        **dict(p.extra),
    )


def build_preset(name: str, *, dtype: torch.dtype = torch.float32, device="cpu", seed: int = 0, layers=None):
    """A randomly initialised causal LM with the shape of preset ``name`` (``layers`` overrides the depth)."""
    import transformers as tf

    config = preset_config(name, layers=layers)
    model_cls = getattr(tf, _FAMILIES[PRESETS[name].family][1])
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        model.set_attn_implementation("eager")  # sdpa cannot softcap attention scores
    return model.to(dtype)
