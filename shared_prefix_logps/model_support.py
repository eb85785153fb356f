"""Find the Hugging Face causal LM inside a wrapped model and prepare it for the two phases.

Preparing a model (idempotent, once per model) does three things, all pass-through for ordinary forwards:

1. routes the phases' attention to :func:`~shared_prefix_logps.attention.shared_prefix_attention`: a registry
   implementation (sdpa, flash, flex_attention, hub kernels) keeps its name and its registry entries are wrapped to
   divert only calls carrying a phase context; an eager model is switched to a registered name that encodes "eager"
   and falls back to the model's own eager function without a phase context;
2. swaps the lm_head's ``forward`` on the instance for a proxy (module hooks of FSDP/ZeRO still fire around it);
3. checks, per model instance and again whenever the head, its hooks, its PEFT wrapping or the logit settings
   change, that the fused head reproduces the model's own logits (unknown logit post-processing must never pass
   silently). The check runs inside an ordinary forward of the model, where sharded wrappers hold full weights.
"""

from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass

import torch
from torch import nn

from . import attention
from .context import (
    CONTEXT_KWARG,
    CaptureContext,
    HeadCheckContext,
    PhaseHandle,
    SharedContext,
    activated,
    active_context,
)
from .errors import UnsupportedModelError
from .head_weights import UnsupportedHeadError, effective_head, head_state
from .routing import RouteBox, attach

#: Decoder-only families whose attention goes through transformers' AttentionInterface and whose head the library
#: reproduces; each is covered by the test suite (tests/test_compute_logps.py, tests/test_model_families.py).
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

#: Rows of completion tokens per chunk of the fused head; None lets the head size chunks from its memory budget.
HEAD_CHUNK_ROWS: int | None = None

# Attribute of the causal LM holding the head signatures (see _head_signature) that passed the check.
_VERIFIED_ATTRIBUTE = "_shared_prefix_verified_heads"


@dataclass(frozen=True)
class HeadSpec:
    """How the model turns final hidden states into logits: ``softcap(scale * hidden @ W.T + b)``."""

    lm_head: nn.Module
    scale: float
    softcap: float | None


@dataclass(frozen=True)
class PreparedModel:
    """A model ready for the two phases.

    Attributes:
        outer: the module the caller passed (DDP, PEFT, ...): every forward goes through it.
        causal_lm: the transformers ``PreTrainedModel`` with the lm_head.
        head: the head's post-processing.
        input_vocab_size: rows of the input embedding (valid input ids are below it).
        output_vocab_size: rows of the lm_head weight (valid target ids are below it).
        device: device of the input embedding.
        rope_length_limit: longest row (padded prompt + completion width) the model's RoPE serves with fixed
            frequencies, or None when its frequencies never depend on the forward's length.
    """

    outer: nn.Module
    causal_lm: nn.Module
    head: HeadSpec
    input_vocab_size: int
    output_vocab_size: int
    device: torch.device
    rope_length_limit: int | None = None


def unwrap_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers causal LM inside DDP/FSDP(1)/DeepSpeed/accelerate/``torch.compile``/PEFT wrappers."""
    from transformers import PreTrainedModel

    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "get_base_model") and callable(model.get_base_model):  # PEFT
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


def prepare_model(model: nn.Module) -> PreparedModel:
    """Check that ``model`` is supported, install the attention function and head proxy, verify the head once.

    Raises:
        UnsupportedModelError: the model type is not supported or its head does not match its logits.
    """
    causal_lm = unwrap_causal_lm(model)
    config = causal_lm.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"model type {model_type!r} ({type(causal_lm).__name__}) is not supported by shared-prefix log-probs; "
            f"supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"model type {model_type!r} is an encoder-decoder model")
    if getattr(config, "use_bidirectional_attention", False):
        # Gemma3 embedding variants: every token sees later ones, so a completion changes its prompt's states.
        raise UnsupportedModelError(
            f"model type {model_type!r} ({type(causal_lm).__name__}) has use_bidirectional_attention=True; "
            "the shared-prefix path needs causal attention"
        )
    head = _head_spec(causal_lm)
    _install_attention(causal_lm)
    _install_head_proxy(head.lm_head)
    embeddings = causal_lm.get_input_embeddings()
    prepared = PreparedModel(
        outer=model,
        causal_lm=causal_lm,
        head=head,
        input_vocab_size=_rows(embeddings),
        output_vocab_size=_rows(head.lm_head),
        device=embeddings.weight.device,
        rope_length_limit=rope_length_limit(causal_lm),
    )
    signature = _head_signature(prepared)
    verified = causal_lm.__dict__.setdefault(_VERIFIED_ATTRIBUTE, set())
    if signature not in verified:
        _verify_head(prepared)
        verified.add(signature)
    return prepared


def _rows(module: nn.Module) -> int:
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
    """The longest row for which every forward, the two phases' and the model's own full-row one, picks the same
    RoPE frequencies; None when no rotary embedding of the model depends on the forward's length.

    ``dynamic`` (NTK) RoPE rescales its frequencies once a forward's largest position reaches the original context
    length, and ``longrope`` switches from its short to its long factors beyond ``original_max_position_embeddings``.
    Both decide per forward from that forward's largest position, so the prompt pass, the completion pass and the
    full-row forward would disagree for rows that cross the threshold.
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


def _head_spec(causal_lm) -> HeadSpec:
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
    if getattr(config, "logit_scale", None) is not None:  # Cohere-style: logits * logit_scale
        scale *= float(config.logit_scale)
    if getattr(config, "logits_scaling", None) is not None:  # Granite-style: logits / logits_scaling
        scale /= float(config.logits_scaling)
    return HeadSpec(lm_head=lm_head, scale=scale, softcap=getattr(config, "final_logit_softcapping", None))


def _install_attention(causal_lm) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    config = causal_lm.config
    current = config._attn_implementation
    if attention.is_shared_prefix_name(current):
        # Prepared before (or deep-copied from a prepared model): the name carries the original; make sure it is
        # registered in this process too.
        _register(AttentionInterface, AttentionMaskInterface, current)
        return
    if hasattr(causal_lm, "_can_set_attn_implementation") and not causal_lm._can_set_attn_implementation():
        raise UnsupportedModelError(
            f"{type(causal_lm).__name__} does not route attention through transformers' AttentionInterface"
        )
    if current == "sdpa" and getattr(config, "attn_logit_softcapping", None) is not None:
        # transformers' sdpa path cannot softcap attention scores: older versions drop the softcap silently (the
        # model's own dense numbers are then not the model's math), newer ones raise.
        raise UnsupportedModelError(
            f"{type(causal_lm).__name__} has attn_logit_softcapping but runs attn_implementation='sdpa', which does "
            "not apply it; load the model with attn_implementation='eager'"
        )
    if current in (None, "eager"):
        # Modeling files call their own eager function without consulting the registry, so the model is switched
        # to a name that encodes "eager" (see attention.implementation_name).
        name = attention.implementation_name("eager")
        _register(AttentionInterface, AttentionMaskInterface, name)
        causal_lm.set_attn_implementation(name)
        return
    if not isinstance(current, str) or current.startswith("paged|") or current not in ALL_ATTENTION_FUNCTIONS:
        raise UnsupportedModelError(
            f"{type(causal_lm).__name__} uses attn_implementation={current!r}, which is not an entry of transformers' "
            "AttentionInterface the shared-prefix path can intercept"
        )
    # Any other implementation (sdpa, flash_attention_2/3/4, flex_attention, hub kernels) keeps its name: its
    # registry entries are wrapped so that only calls carrying a phase context take the shared-prefix path.
    AttentionInterface.register(current, attention.intercepting(ALL_ATTENTION_FUNCTIONS[current]))
    if current in ALL_MASK_ATTENTION_FUNCTIONS:
        AttentionMaskInterface.register(current, _intercepting_mask(ALL_MASK_ATTENTION_FUNCTIONS[current]))


def _intercepting_mask(original):
    """The mask builder of an intercepted implementation: none inside a phase (the shared-prefix attention builds
    its own masks from the phase context, so no rows x keys tensor is made), ``original`` otherwise."""
    if getattr(original, "_shared_prefix_original", None) is not None:
        return original

    def build(*args, **kwargs):
        return None if _in_phase() else original(*args, **kwargs)

    build._shared_prefix_original = original
    return build


def _in_phase() -> bool:
    """Whether a prompt or completion pass is running (not a plain forward, nor the head check's forward)."""
    return isinstance(active_context(), (CaptureContext, SharedContext))


def _register(attention_interface, mask_interface, name: str) -> None:
    attention_interface.register(name, attention.shared_prefix_attention)
    mask_interface.register(name, _shared_prefix_mask)


def _shared_prefix_mask(*args, config=None, **kwargs):
    """Mask builder registered beside the attention function.

    Inside a phase the attention function builds its own masks from the context, so transformers builds none
    (no rows x keys tensor); outside a phase the original implementation's mask builder runs.
    """
    if _in_phase():
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = attention.original_implementation_name(config) if config is not None else "sdpa"
    builder = ALL_MASK_ATTENTION_FUNCTIONS[name if name in ("sdpa", "eager") else "sdpa"]
    return builder(*args, config=config, **kwargs)


def _install_head_proxy(lm_head: nn.Module) -> None:
    if getattr(lm_head, "_shared_prefix_original_forward", None) is not None:
        return
    lm_head._shared_prefix_original_forward = lm_head.forward
    lm_head.forward = types.MethodType(_lm_head_proxy_forward, lm_head)


def _lm_head_proxy_forward(self, hidden_states, *args, **kwargs):
    """lm_head forward inside the model's forward: full logits normally, fused log-probs inside Phase 2."""
    context = active_context()
    if context is None:
        return self._shared_prefix_original_forward(hidden_states, *args, **kwargs)
    if isinstance(context, HeadCheckContext):
        logits = self._shared_prefix_original_forward(hidden_states, *args, **kwargs)
        context.calls += 1
        with torch.no_grad():
            context.fused_logits = fused_logits(self, context.spec, hidden_states)
        return logits
    # Neither phase returns logits: the model gets a tensor of the right rank with an empty vocabulary axis, for any
    # post-processing it applies. It is a view of the hidden states, so gradient reaching the model's output flows
    # on into the model (wrappers' backward hooks fire on the way), and DDP's unused-parameter search walks it.
    if isinstance(context, CaptureContext):
        return hidden_states[..., :0]
    if not isinstance(context, SharedContext):
        raise TypeError(f"unexpected phase context {type(context).__name__}")
    from .head import linear_logps

    spec = context.head_spec
    hidden = hidden_states[context.query_valid]
    if spec.scale != 1.0:
        hidden = hidden * spec.scale
    weight, bias = effective_head(self)
    results = linear_logps(
        hidden,
        weight,
        context.head_targets,
        bias=bias,
        temperature=context.temperature,
        softcap=spec.softcap,
        return_entropy=context.return_entropy,
        chunk_size=HEAD_CHUNK_ROWS,
    )
    results = results if context.return_entropy else (results,)
    context.route = RouteBox()
    # The log-probs leave on the head's output (and so on the model's), where wrappers see their gradient arrive.
    return attach(hidden_states[..., :0], context.route, *results)


def fused_logits(lm_head: nn.Module, spec: HeadSpec, hidden: torch.Tensor) -> torch.Tensor:
    """Full float32 logits ``softcap(scale * hidden @ W.T + b)`` as the fused head computes them, with ``W, b`` the
    head's effective weight and bias (for checks on a few rows, not for training; call inside the forward)."""
    weight, bias = effective_head(lm_head)
    hidden = hidden * spec.scale if spec.scale != 1.0 else hidden
    logits = torch.nn.functional.linear(hidden.to(weight.dtype), weight, bias).float()
    if spec.softcap is not None:
        logits = torch.tanh(logits / spec.softcap) * spec.softcap
    return logits


def _head_signature(prepared: PreparedModel) -> tuple:
    """What the head check's verdict depends on: the head module and its PEFT state, the hooks that could change
    logits on their way out (on the head, the causal LM and the outer module, and global ones), and the logit
    settings read from the config. A model deep-copied after use has new modules, hence a new signature."""
    from torch.nn.modules import module as module_globals

    spec = prepared.head
    lm_head = spec.lm_head
    hooks = []
    for module in {id(m): m for m in (lm_head, prepared.causal_lm, prepared.outer)}.values():
        hooks.append((id(module), tuple(module._forward_hooks)))
    # Only forward (post) hooks can change logits behind the fused head's back: a pre-hook changes inputs, which the
    # fused head then receives as the module would.
    global_hooks = tuple(module_globals._global_forward_hooks)
    return (id(lm_head), head_state(lm_head), tuple(hooks), global_hooks, spec.scale, spec.softcap)


def _gathered_outside_engine(module: nn.Module):
    """ZeRO-3 parameters partitioned outside an engine (``deepspeed.zero.Init``, as transformers loads a model under
    a ZeRO-3 config, before ``deepspeed.initialize`` installs the hooks that gather them in each forward) are empty
    tensors: gather them for the block (a collective, as the engine's own forward would be). A module an engine has
    registered (its modules carry ``ds_id``) gathers its parameters itself."""
    params = [param for param in module.parameters() if hasattr(param, "ds_id")]
    if not params or hasattr(module, "ds_id"):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def _verify_head(prepared: PreparedModel) -> None:
    """Compare the fused head's logits with the model's own on a few tokens, inside one ordinary forward of the
    outermost module; raise if they differ."""
    name = type(prepared.causal_lm).__name__
    check = HeadCheckContext(spec=prepared.head)
    ids = torch.arange(1, min(prepared.input_vocab_size, 5), device=prepared.device)[None]
    # The layers attend through the shared-prefix attention (a one-prompt Phase 1), so the check does not depend on
    # the model's own implementation being runnable here (a flash-attention name on a CPU tensor, say).
    positions = torch.arange(ids.shape[1], device=prepared.device)[None]
    attend = CaptureContext(key_valid=torch.ones_like(ids, dtype=torch.bool), positions=positions, needs_grad=False)
    try:
        with torch.no_grad(), _gathered_outside_engine(prepared.causal_lm), activated(check):
            output = prepared.outer(
                input_ids=ids, position_ids=positions, use_cache=False, **{CONTEXT_KWARG: PhaseHandle(attend)}
            )
        logits = output.logits.float()
    except UnsupportedHeadError as error:
        raise UnsupportedModelError(f"{name}: {error}") from None
    if check.calls != 1:
        raise UnsupportedModelError(f"{name} called its lm_head {check.calls} times in one forward")
    ours = check.fused_logits
    if ours.shape != logits.shape:
        raise UnsupportedModelError(
            f"{name}: logits of shape {tuple(logits.shape)} do not come from the lm_head alone "
            f"(head gives {tuple(ours.shape)})"
        )
    weight_dtype = prepared.head.lm_head.weight.dtype
    tolerance = 1e-4 if weight_dtype in (torch.float32, torch.float64) else 2e-2
    error = (ours - logits).abs().max().item()
    if not error <= tolerance * max(1.0, logits.abs().max().item()):
        raise UnsupportedModelError(
            f"{name} post-processes its logits in a way the fused head does not reproduce (max |difference| "
            f"{error:.3g}: a config logit setting its class ignores, a hook on the head or the model, or a head "
            "wrapper); refusing to compute log-probs that could be wrong"
        )


def force_non_reentrant_checkpointing(causal_lm: nn.Module):
    """Context manager: run reentrant activation checkpointing of transformers layers as non-reentrant.

    Reentrant checkpointing runs layers with gradients disabled, so the captured prompt keys/values would carry no
    gradient. The non-reentrant variant recomputes the same layers exactly; its recomputation is bound at forward
    time, so restoring the original function afterwards is safe even though backward runs later.
    """
    return _SwappedCheckpointing(causal_lm)


class _SwappedCheckpointing:
    def __init__(self, causal_lm):
        self.causal_lm = causal_lm
        self.swapped = []

    def __enter__(self):
        from torch.utils.checkpoint import checkpoint

        for module in self.causal_lm.modules():
            func = getattr(module, "_gradient_checkpointing_func", None)
            if not getattr(module, "gradient_checkpointing", False) or func is None:
                continue
            if isinstance(func, functools.partial) and func.func is checkpoint and func.keywords.get("use_reentrant"):
                keywords = {**func.keywords, "use_reentrant": False}
                self.swapped.append((module, func))
                module._gradient_checkpointing_func = functools.partial(checkpoint, *func.args, **keywords)
        return self

    def __exit__(self, *exc):
        for module, func in self.swapped:
            module._gradient_checkpointing_func = func
        return False
