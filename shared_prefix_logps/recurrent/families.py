"""Which model families' recurrent layers can continue from a given state through their own code, how, and which of
them this package serves; the reasons double as the refusals' messages.

Facts from transformers 5.24 (the development venv) and 5.17 (the GPU image), checked on tiny random models: each
family's own cache continuation against its full forward, and :func:`~.layer.run_from_states` split at several
points against the layer's full forward, with gradients (tests/recurrent/test_family_verdicts.py repeats the checks).

The channel :mod:`.cache` speaks is the linear-attention cache layer of transformers >= 5.15 (``record_past`` honoured
by the one-token path, ``update_conv_state`` returning the inputs to convolve). Older versions:

- 5.10-5.14 (checked: 5.10.4, 5.13.1, 5.14.1): the Gated DeltaNet layers continue a multi-token segment, but prepend
  the window themselves and take the one-token path (``causal_conv1d_update``, writing the window in place) whenever
  a state is present;
- up to 5.5 (checked: 4.57.6, 5.0.0, 5.2.0, 5.5.4): a multi-token forward ignores the cached state (the chunked
  kernel gets ``initial_state=None`` and the convolution pads with zeros); only one-token decoding continues.
- The lowest transformers the package admits (4.56.2) has none of the Gated DeltaNet families (Qwen3-Next arrives in
  4.57, Qwen3.5 in 5.2); its Mamba2 families (bamba, falcon_h1, granitemoehybrid, mamba2, zamba2) predate the cache
  layer interface.
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers
from packaging.version import Version
from torch import nn

from ..errors import UnsupportedModelError

#: The first transformers whose recurrent layers continue through the channel of :mod:`.cache`.
MIN_TRANSFORMERS = Version("5.15.0")


@dataclass(frozen=True)
class FamilyVerdict:
    """What state forking can do with one model family.

    Attributes:
        continues: its recurrent layers continue a multi-token segment from a given state through their own code.
        served: this package forks its states (``continues`` and exact at the model level in the test suite).
        layers: class names of its recurrent layers (the modules :func:`install` wraps).
        how: how it continues (continues) or why it cannot; with ``served`` False the refusal's reason.
        one_token: whether a one-token segment starting from a state back-propagates into that state through the
            layer's decode path on CPU (transformers' torch fallbacks); None where not checked.
    """

    continues: bool
    served: bool
    layers: tuple[str, ...]
    how: str
    one_token: bool | None = None


_GDN = (
    "Gated DeltaNet through the linear-attention cache: the window goes through update_conv_state, the chunked "
    "kernel (torch_chunk_gated_delta_rule, flash-linear-attention's chunk_gated_delta_rule) starts from "
    "initial_state and returns the final state"
)
_KDA = (
    "Kimi delta attention through the linear-attention cache: update_conv_state for the q/k/v windows, the chunked "
    "KDA kernel from initial_state"
)
_MAMBA2 = (
    "Mamba2 mixer through the linear-attention cache: update_conv_state, then mamba_chunk_scan_combined (torch "
    "fallback mamba2_chunk_scan) from initial_states with the final state returned. A one-token segment takes the "
    "decode path, whose selective_state_update overwrites the state it read (in place) after saving it for backward: "
    "under gradients a one-token node cannot start from a state that needs its gradient"
)
_MAMBA1 = (
    "Mamba-1 selective scan: the scan (mamba-ssm's selective_scan_fn, its torch fallback) takes no initial state, so "
    "a multi-token segment restarts the recurrence from zero; only one-token decoding continues from the cache"
)
_SHORT_CONV = (
    "short convolution only (no recurrence): the window goes through update_conv_state, and a one-token segment "
    "takes the same path under record_past"
)
_NOT_YET = "; not served yet: no model-level exactness test"

#: Every family of transformers 5.24 whose layers keep a recurrent state, by ``config.model_type``.
VERDICTS: dict[str, FamilyVerdict] = {
    **dict.fromkeys(
        ("qwen3_5", "qwen3_5_text"), FamilyVerdict(True, True, ("Qwen3_5GatedDeltaNet",), _GDN, one_token=True)
    ),
    **dict.fromkeys(
        ("qwen3_5_moe", "qwen3_5_moe_text"),
        FamilyVerdict(True, True, ("Qwen3_5MoeGatedDeltaNet",), _GDN, one_token=True),
    ),
    "qwen3_next": FamilyVerdict(True, True, ("Qwen3NextGatedDeltaNet",), _GDN, one_token=True),
    "olmo_hybrid": FamilyVerdict(True, False, ("OlmoHybridGatedDeltaNet",), _GDN + _NOT_YET, one_token=True),
    "lara_mini": FamilyVerdict(True, False, ("LaraMiniGatedDeltaNet",), _GDN + _NOT_YET, one_token=True),
    **dict.fromkeys(
        ("qwen4_exp", "qwen4_exp_text"),
        FamilyVerdict(
            True,
            False,
            ("Qwen4ExpTextGatedDeltaNet",),
            _GDN + "; not served: its attention layers are indexer-selected sparse attention, which the attention "
            "path does not serve",
            one_token=True,
        ),
    ),
    "kimi_linear": FamilyVerdict(True, False, ("KimiLinearDeltaAttention",), _KDA + _NOT_YET, one_token=True),
    "bailing_hybrid": FamilyVerdict(True, False, ("BailingHybridDeltaAttention",), _KDA + _NOT_YET, one_token=True),
    **dict.fromkeys(
        ("glm5_next", "glm5_next_text"),
        FamilyVerdict(
            True,
            False,
            ("Glm5NextTextLinearAttention",),
            "linear attention through the linear-attention cache (update_conv_state, initial_state); not served: a "
            "one-token segment takes causal_conv1d_update whatever record_past says, writing the window in place, "
            "and transformers has no text-only causal LM for it",
            one_token=False,
        ),
    ),
    **{
        model_type: FamilyVerdict(True, False, (layer,), _MAMBA2 + _NOT_YET, one_token=False)
        for model_type, layer in (
            ("nemotron_h", "NemotronHMamba2Mixer"),
            ("granitemoehybrid", "GraniteMoeHybridMambaLayer"),
            ("falcon_h1", "FalconH1Mixer"),
            ("bamba", "BambaMixer"),
            ("mamba2", "Mamba2Mixer"),
            ("zamba2", "Zamba2MambaMixer"),
        )
    },
    **{
        model_type: FamilyVerdict(True, False, (layer,), _SHORT_CONV + _NOT_YET, one_token=True)
        for model_type, layer in (
            ("lfm2", "Lfm2ShortConv"),
            ("lfm2_moe", "Lfm2MoeShortConv"),
            ("lfm3", "Lfm3ShortConv"),
        )
    },
    **{
        model_type: FamilyVerdict(
            True,
            False,
            (layer,),
            "short convolutions through the linear-attention cache, several windows per layer (state_idx); not "
            "served: not checked through this package (its tiny model's layer inputs are not the hidden states)",
        )
        for model_type, layer in (
            ("inkling_text", "InklingShortConvolution"),
            ("inkling_mm_model", "InklingShortConvolution"),
            ("inkling2", "Inkling2ShortConvolution"),
            ("inkling2_text", "Inkling2ShortConvolution"),
            ("inkling2_loop", "Inkling2LoopShortConvolution"),
            ("inkling2_loop_text", "Inkling2LoopShortConvolution"),
        )
    },
    "zaya": FamilyVerdict(
        True,
        False,
        ("ZayaCCAProjection",),
        "its recurrent part is a convolution inside the attention's query/key projection (ZayaCCAProjection), which "
        "builds the window it stores itself and returns queries, keys and values, not a layer output",
    ),
    "minimax": FamilyVerdict(
        True,
        False,
        ("MiniMaxLightningAttention",),
        "lightning attention continues through its own cache class (MiniMaxCache.get_linear_cache / "
        "set_linear_cache, a token-by-token loop from the given state), not the linear-attention cache layer this "
        "package speaks",
    ),
    "rwkv": FamilyVerdict(
        True,
        False,
        ("RwkvSelfAttention", "RwkvFeedForward"),
        "the state is one model-level `state` argument (five tensors over all layers) that every layer writes in "
        "place, not a per-layer cache",
    ),
    **{
        model_type: FamilyVerdict(False, False, (layer,), _MAMBA1)
        for model_type, layer in (
            ("mamba", "MambaMixer"),
            ("falcon_mamba", "FalconMambaMixer"),
            ("jamba", "JambaMambaMixer"),
            ("zamba", "ZambaMambaMixer"),
        )
    },
    "recurrent_gemma": FamilyVerdict(
        False,
        False,
        ("RecurrentGemmaRecurrentBlock",),
        "the states live on the modules (conv1d_state, rg_lru.recurrent_states), not in a cache argument, and a "
        "multi-token forward restarts the convolution from zeros",
    ),
}


def family_verdict(config) -> tuple[str, FamilyVerdict] | None:
    """(model type, verdict) of a model config, looked up by its own ``model_type`` and then its text config's (a
    vision-language model whose language model is a hybrid); None for a family without recurrent layers."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for model_type in (getattr(config, "model_type", None), getattr(text_config, "model_type", None)):
        if model_type in VERDICTS:
            return model_type, VERDICTS[model_type]
    return None


def served_model_types() -> frozenset[str]:
    """The model types whose recurrent states this package forks (with transformers >= :data:`MIN_TRANSFORMERS`)."""
    return frozenset(model_type for model_type, verdict in VERDICTS.items() if verdict.served)


def check_served(causal_lm: nn.Module) -> FamilyVerdict | None:
    """The verdict of ``causal_lm``'s family if state forking serves it; None for a family without recurrent
    layers. Raises :class:`UnsupportedModelError` naming the model type and the reason otherwise."""
    found = family_verdict(causal_lm.config)
    if found is None:
        return None
    model_type, verdict = found
    name = f"model type {model_type!r} ({type(causal_lm).__name__})"
    if not verdict.served:
        raise UnsupportedModelError(
            f"{name} keeps recurrent states that cannot be forked to shared prefixes: {verdict.how}"
        )
    if Version(transformers.__version__) < MIN_TRANSFORMERS:
        raise UnsupportedModelError(
            f"{name} needs transformers >= {MIN_TRANSFORMERS} to fork its recurrent states (its layers continue a "
            f"segment from a given state through the linear-attention cache from that version on); installed: "
            f"{transformers.__version__}"
        )
    return verdict


def recurrent_layers(causal_lm: nn.Module, verdict: FamilyVerdict) -> list[nn.Module]:
    """The recurrent layers of ``causal_lm`` (modules whose class is one of ``verdict.layers``), in module order."""
    layers = [module for module in causal_lm.modules() if type(module).__name__ in verdict.layers]
    if not layers:
        raise UnsupportedModelError(
            f"{type(causal_lm).__name__} holds none of its family's recurrent layers ({', '.join(verdict.layers)}); "
            "this transformers version names them differently"
        )
    return layers
