"""Model presets built from configs with random weights (nothing is downloaded).

The named presets mirror the shapes of real checkpoints (DESIGN.md); ``tiny`` is a small Qwen2-style model that
runs anywhere in seconds. :func:`build_model` also builds the shape of a user's ``config.json``.

Linear-attention hybrids, from the text configs of the published ``config.json`` files (every fourth layer gated
attention, the others Gated DeltaNet with a 4-tap convolution; 16 key heads and 32 value heads of 128 in the
Gated DeltaNet layers; untied embeddings):

- ``qwen3.5-9b`` (Qwen/Qwen3.5-9B, dense): hidden 4096, 32 layers, 16 attention heads, 4 KV heads, head dim 256,
  MLP 12288, vocabulary 248320.
- ``qwen3.5-35b-a3b`` (Qwen/Qwen3.5-35B-A3B, MoE): hidden 2048, 40 layers, 16 heads, 2 KV heads, head dim 256, 256
  experts of 512, 8 per token, a shared expert of 512, vocabulary 248320. Every layer is routed: its config has no
  dense MLP width, and neither has the preset (``mlp`` None).
- ``qwen3-next-80b-a3b`` (Qwen/Qwen3-Next-80B-A3B-Instruct): hidden 2048, 48 layers, 16 heads, 2 KV heads, head dim
  256, 512 experts of 512, 10 per token, a shared expert of 512, vocabulary 151936. Every layer is routed (the
  config's ``intermediate_size`` 5120 is unused by the layers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Preset:
    """Shape of a decoder-only model; see :func:`build_preset`. ``mlp``: the dense MLP's width (``intermediate_size``),
    None for a family whose every layer is routed and whose config has no such field."""

    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int | None
    vocab: int
    tied: bool
    extra: tuple = ()


#: The Gated DeltaNet sizes the Qwen3.5 and Qwen3-Next configs share (the layer pattern comes from the configs'
#: default ``full_attention_interval`` of 4, so ``--layers`` keeps it).
_GATED_DELTANET = (
    ("linear_num_key_heads", 16),
    ("linear_num_value_heads", 32),
    ("linear_key_head_dim", 128),
    ("linear_value_head_dim", 128),
    ("linear_conv_kernel_dim", 4),
)

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
    "qwen3.5-9b": Preset("qwen3_5_text", 4096, 32, 16, 4, 256, 12288, 248320, False, _GATED_DELTANET),
    "qwen3.5-35b-a3b": Preset(
        "qwen3_5_moe_text",
        2048,
        40,
        16,
        2,
        256,
        None,
        248320,
        False,
        (
            *_GATED_DELTANET,
            ("num_experts", 256),
            ("num_experts_per_tok", 8),
            ("moe_intermediate_size", 512),
            ("shared_expert_intermediate_size", 512),
        ),
    ),
    "qwen3-next-80b-a3b": Preset(
        "qwen3_next",
        2048,
        48,
        16,
        2,
        256,
        5120,
        151936,
        False,
        (
            *_GATED_DELTANET,
            ("num_experts", 512),
            ("num_experts_per_tok", 10),
            ("moe_intermediate_size", 512),
            ("shared_expert_intermediate_size", 512),
        ),
    ),
}


_FAMILIES = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}


def preset_config(name: str, *, layers=None):
    """The transformers config of preset ``name`` (``layers`` overrides the depth); no weights are made."""
    import transformers as tf

    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    p = PRESETS[name]
    config_cls = getattr(tf, _FAMILIES[p.family][0])
    dense = {} if p.mlp is None else {"intermediate_size": p.mlp}
    return config_cls(
        vocab_size=p.vocab,
        hidden_size=p.hidden,
        **dense,
        num_hidden_layers=layers or p.layers,
        num_attention_heads=p.heads,
        num_key_value_heads=p.kv_heads,
        head_dim=p.head_dim,
        tie_word_embeddings=p.tied,
        max_position_embeddings=131072,
        **dict(p.extra),
    )


def build_preset(name: str, *, dtype=None, device="cpu", seed: int = 0, layers=None):
    """A randomly initialised causal LM with the shape of preset ``name`` (``layers`` overrides the depth), in
    ``dtype`` (default: float32)."""
    import torch
    import transformers as tf

    dtype = torch.float32 if dtype is None else dtype
    config = preset_config(name, layers=layers)
    model_cls = getattr(tf, _FAMILIES[PRESETS[name].family][1])
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config)
    if getattr(model.config, "attn_logit_softcapping", None) is not None:
        model.set_attn_implementation("eager")  # sdpa cannot softcap attention scores
    return model.to(dtype)


def model_config(model: str, *, layers=None):
    """The transformers config of ``model``: a preset name, or a ``config.json`` path (or a directory holding one);
    ``layers`` overrides a preset's depth and keeps a config's first ``layers`` layers. No weights are made.

    Raises:
        ValueError: naming what is wrong with ``model`` or ``layers`` (an unknown preset that is no path, an
            unreadable config, a model type this transformers does not know).
    """
    if model in PRESETS:
        return preset_config(model, layers=layers)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown preset {model!r} and no config.json there; choose from {', '.join(PRESETS)}")
    try:
        fields = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{str(path)!r} is not a readable JSON config: {error}") from error
    if not isinstance(fields, dict) or not isinstance(fields.get("model_type"), str):
        raise ValueError(f"{str(path)!r} holds no transformers config (no 'model_type')")
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers <= 0:
            raise ValueError(f"layers must be a positive integer, got {layers!r}")
        kinds = fields.get("layer_types")
        if isinstance(kinds, list):
            if layers > len(kinds):
                raise ValueError(f"layers={layers}: {str(path)!r} lists layer_types for {len(kinds)} layers")
            fields["layer_types"] = kinds[:layers]
        fields["num_hidden_layers"] = layers
    import transformers

    model_type = fields.pop("model_type")
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"{str(path)!r}: transformers cannot build a {model_type!r} config: {error}") from error


def build_model(model: str, *, dtype=None, device="cpu", seed: int = 0, layers=None):
    """A randomly initialised causal LM of ``model``'s shape (a preset name, or a ``config.json`` path or directory:
    :func:`model_config`), in ``dtype`` (default: float32).

    Raises:
        ValueError: as :func:`model_config`, or a config of no causal LM.
    """
    if model in PRESETS:
        return build_preset(model, dtype=dtype, device=device, seed=seed, layers=layers)
    import torch
    import transformers

    config = model_config(model, layers=layers)
    torch.manual_seed(seed)
    try:
        with torch.device(device):
            built = transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as error:
        raise ValueError(f"{model!r} is not a causal LM config transformers can build: {error}") from error
    if getattr(built.config, "attn_logit_softcapping", None) is not None:
        built.set_attn_implementation("eager")  # sdpa cannot softcap attention scores
    return built.to(torch.float32 if dtype is None else dtype)
