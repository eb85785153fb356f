"""What the library reads from a model before touching it: the causal LM inside its wrappers, whether its family is
supported, its vocabulary sizes, how its head turns hidden states into logits, and how long its rows may be."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UnsupportedModelError
from ..recurrent.families import check_served, served_model_types

#: Decoder-only families whose attention goes through transformers' AttentionInterface and whose head the library
#: reproduces; each is covered by the test suite (tests/core/test_compute_logps.py,
#: tests/models/test_model_families.py).
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma2",
        "phi3",
        # mixture-of-experts: routing is per token, so forwarding a prompt once routes it as the dense rows do
        "qwen2_moe",
        "qwen3_moe",
        "mixtral",
        "gpt_oss",  # also attention sinks (s_aux)
        "glm4_moe",
        "deepseek_v3",  # also multi-head latent attention (key head dim != value head dim)
        "gemma3_text",
        "olmo2",
        "cohere",
        "cohere2",
        "glm4",
        "granite",
    }
)


@dataclass(frozen=True)
class HeadSpec:
    """How the model turns final hidden states into logits: ``softcap(scale * hidden @ W.T + b)``."""

    lm_head: nn.Module
    scale: float
    softcap: float | None


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside DDP/FSDP(1)/DeepSpeed/accelerate/``torch.compile``/PEFT wrappers."""
    from transformers import PreTrainedModel

    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "get_base_model") and callable(model.get_base_model):  # PEFT
            _refuse_prompt_learning(model)
            model = model.get_base_model()
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module) and not isinstance(model, PreTrainedModel):
            # DDP, FSDP1, DeepSpeed's engine. The engine forwards unknown attributes to the model (``config``,
            # ``get_output_embeddings``), and has a ``config`` of its own, so attributes cannot tell it apart.
            model = model.module
        else:
            break
    if not hasattr(model, "config") or not hasattr(model, "get_output_embeddings"):
        raise UnsupportedModelError(
            "model must be a transformers causal LM (optionally wrapped by PEFT/DDP/FSDP/DeepSpeed), got "
            f"{type(model).__name__}"
        )
    return model


def _refuse_prompt_learning(peft_model: nn.Module) -> None:
    """PEFT prompt learning (prompt tuning, prefix tuning, p-tuning, ...) adds virtual tokens in the PEFT model's own
    forward: embeddings before every row or keys/values before every layer's, with positions ignored. Node calls'
    rows, positions and prefix keys/values would not be the ones the model attends over."""
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    for name, config in configs.items():
        if getattr(config, "is_prompt_learning", False):
            kind = getattr(config, "peft_type", None)
            kind = getattr(kind, "value", kind)
            raise UnsupportedModelError(
                f"PEFT prompt learning ({kind}, adapter {name!r}) is not supported: its virtual tokens enter every "
                "row inside the PEFT model's forward, which the shared prompt pass cannot reproduce. Use an adapter "
                "that changes weights (LoRA and its relatives) or score the base model"
            )


def check_supported(model: nn.Module) -> nn.Module:
    """The causal LM inside ``model``, if its family is supported and its attention causal; else raise
    :class:`UnsupportedModelError` naming the reason."""
    causal_lm = unwrap_causal_lm(model)
    config = causal_lm.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES and not _served_hybrid(causal_lm):
        supported = sorted(SUPPORTED_MODEL_TYPES | served_model_types())
        raise UnsupportedModelError(
            f"model type {model_type!r} ({type(causal_lm).__name__}) is not supported by shared-prefix log-probs; "
            f"supported: {', '.join(supported)}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model type {model_type!r} is an encoder-decoder model")
    if getattr(config, "use_bidirectional_attention", False):
        # Gemma3 embedding variants: every token sees later ones, so a completion changes its prompt's states.
        raise UnsupportedModelError(
            f"model type {model_type!r} ({type(causal_lm).__name__}) has use_bidirectional_attention=True; "
            "the shared-prefix path needs causal attention"
        )
    return causal_lm


def _served_hybrid(causal_lm: nn.Module) -> bool:
    """Whether ``causal_lm`` is a linear-attention hybrid whose recurrent states the node calls fork
    (``recurrent/families.py``); False for a family without recurrent layers. Raises
    :class:`UnsupportedModelError` naming the reason for a hybrid that is not served, and for a served family's
    vision-language model (its language model, loaded as a causal LM, is served)."""
    if check_served(causal_lm) is None:
        return False
    name = type(causal_lm).__name__
    if not name.endswith("ForCausalLM"):
        raise UnsupportedModelError(
            f"model type {causal_lm.config.model_type!r} ({name}) is a vision-language model: its position scheme is "
            "not served; load its language model as a causal LM (AutoModelForCausalLM) to compute shared-prefix "
            "log-probs"
        )
    return True


def vocab_rows(module: nn.Module) -> int:
    """Vocabulary rows of an embedding or head, from the torch module's own size attributes where it has them:
    sharding wrappers (FSDP1 with ``use_orig_params``, ZeRO-3) leave parameters flattened or empty outside a
    forward. PEFT wrappers are looked through (their ``out_features`` is an embedding's width, not its rows)."""
    for _ in range(8):
        inner = getattr(module, "base_layer", None) or getattr(module, "original_module", None)
        if not isinstance(inner, nn.Module):
            break
        module = inner
    if isinstance(module, nn.Embedding):
        return module.num_embeddings
    if isinstance(module, nn.Linear):
        return module.out_features
    return full_shape(module.weight)[0]


def full_shape(param: torch.Tensor) -> torch.Size:
    """A parameter's shape as the model defines it. Outside a forward, DeepSpeed ZeRO-3 leaves each parameter an
    empty 1-D placeholder (its own rank's shard lives elsewhere) and keeps the real shape in ``ds_shape``."""
    shape = getattr(param, "ds_shape", None)
    return torch.Size(shape) if shape is not None else param.shape


def rope_length_limit(causal_lm: nn.Module) -> int | None:
    """The longest row for which every forward, each node call's and the model's own full-row one, picks the same
    RoPE frequencies; None when no rotary embedding of the model depends on the forward's length.

    ``dynamic`` (NTK) RoPE rescales its frequencies once a forward's largest position reaches the original context
    length, and ``longrope`` switches from its short to its long factors beyond ``original_max_position_embeddings``.
    Both decide per forward from that forward's largest position, so the node calls and the full-row forward would
    disagree for rows that cross the threshold.
    """
    limit = None
    for module in causal_lm.modules():
        kinds = getattr(module, "rope_type", None)
        if kinds is None:
            continue
        for layer_type, kind in kinds.items() if isinstance(kinds, dict) else [(None, kinds)]:
            if not isinstance(kind, str):
                continue
            if "dynamic" in kind:
                # Frequencies stay the original ones only while the largest position + 1 is below this.
                bound = int(module.original_max_seq_len) - 1
            elif kind == "longrope":
                bound = _longrope_original_length(module.config, layer_type)
            else:
                continue
            limit = bound if limit is None else min(limit, bound)
    return limit


def _longrope_original_length(config, layer_type: str | None) -> int:
    """The length past which ``longrope`` switches to its long factors, read where the installed transformers
    reads it: ``rope_parameters`` from 5.0 on; before, ``config.original_max_position_embeddings`` with
    ``max_position_embeddings`` as its fallback."""
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict):
        if layer_type is not None:
            parameters = parameters[layer_type]
        return int(parameters["original_max_position_embeddings"])
    original = getattr(config, "original_max_position_embeddings", None)
    return int(original if original is not None else config.max_position_embeddings)


def head_spec(causal_lm) -> HeadSpec:
    """The lm_head to fuse and the logit scale and final softcap the model applies after it.

    Raises:
        UnsupportedModelError: for a head without a 2-D weight, or a ``logit_scale`` tensor that is not one constant.
    """
    lm_head = causal_lm.get_output_embeddings()
    # An nn.Linear head has a 2-D weight by construction (sharding wrappers may show it flattened outside a forward;
    # inside, effective_head reads the real one). Anything else must show a 2-D weight here.
    linear = isinstance(lm_head, nn.Linear) or isinstance(getattr(lm_head, "base_layer", None), nn.Linear)
    weight = getattr(lm_head, "weight", None)
    if not linear and (not isinstance(weight, torch.Tensor) or len(full_shape(weight)) != 2):
        raise UnsupportedModelError(
            f"the lm_head of {type(causal_lm).__name__} ({type(lm_head).__name__}) has no 2-D weight to fuse"
        )
    config = causal_lm.config
    scale = 1.0
    logit_scale = _logit_scale(causal_lm)
    if logit_scale is not None:  # Cohere-style: logits * logit_scale
        scale *= logit_scale
    if getattr(config, "logits_scaling", None) is not None:  # Granite-style: logits / logits_scaling
        scale /= float(config.logits_scaling)
    return HeadSpec(lm_head=lm_head, scale=scale, softcap=getattr(config, "final_logit_softcapping", None))


def _logit_scale(causal_lm) -> float | None:
    """The Cohere-style factor the model's forward multiplies its logits by, or None.

    Cohere's forward multiplies by the instance attribute ``logit_scale``, copied from the config at construction: a
    caller who sets the attribute afterwards changes the model's logits and not its config, so the attribute, where
    the instance has one, is what counts. A model without it that carries ``config.logit_scale`` gets the config's
    (its class may ignore it: the head check then refuses the model)."""
    value = getattr(causal_lm, "logit_scale", None)
    if value is None:
        value = getattr(causal_lm.config, "logit_scale", None)
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.requires_grad:
            raise UnsupportedModelError(
                f"{type(causal_lm).__name__}.logit_scale is a tensor of shape {tuple(value.shape)}"
                f"{' that requires grad' if value.requires_grad else ''}; the fused head takes a constant scale"
            )
        return float(value.item())
    return float(value)
