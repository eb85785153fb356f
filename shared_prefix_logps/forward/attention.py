"""The attention function registered with transformers' ``AttentionInterface``.

transformers calls it from every attention layer with post-RoPE ``query`` (batch, heads, q_len, head_dim) and
``key``/``value`` (batch, kv_heads, k_len, head_dim). It dispatches on the phase context passed as a model kwarg:

- no context: the model's original implementation, untouched (generation and plain forwards);
- :class:`CaptureContext`: Phase 1, causal attention over the left-padded prompts, recording keys/values;
- :class:`SharedContext`: Phase 2, completion queries over [group prefix ; own tokens causally];
- :class:`~shared_prefix_logps.tree.context.TreeContext`: a prefix-tree node call (``tree/attention.py``).

The attention itself is computed by the phase's backend (``backends/``): ``expand`` (SDPA over per-row gathered
keys), ``flex`` (packed rows, one ``flex_attention`` call) or ``flash`` (packed rows, flash-attn's varlen kernels);
the ``dense`` backend has no phases.
"""

from __future__ import annotations

import sys

import torch

from ..backends import expand, flash, flex
from ..tree.attention import tree_attention
from ..tree.context import TreeContext
from .context import CONTEXT_KWARG, CaptureContext, PhaseHandle, SharedContext
from .routing import RouteBox, attach

#: Prefix of the names under which the function is registered. transformers matches implementation names by substring
#: ("sdpa", "flash", "flex_attention" switch on special code paths), so none of those may appear in a name.
ATTENTION_NAME = "shared_prefix_logps"

# Separates ATTENTION_NAME from the hex-encoded name of the implementation the model had before.
_ORIGINAL_SEPARATOR = "__"

# Attention kwargs that change the math in ways the shared path does not implement. (``sinks`` is the per-token
# variant some models pass; the per-head learned sinks of GPT-OSS arrive as ``s_aux`` and are implemented.)
_UNSUPPORTED_KWARGS = ("sinks", "attention_chunk_size", "position_bias")


class ReentrantCheckpointError(RuntimeError):
    """Raised when a layer runs under reentrant activation checkpointing, which would drop the prompt's gradient."""


def implementation_name(original: str) -> str:
    """The name the model's config carries while the shared-prefix function is selected over ``original``.

    The original implementation is encoded in the name itself (hex, so no substring such as "sdpa" appears), so it
    travels with the config: deep copies, pickles and other processes recover it, and no table keyed by object
    identity can go stale. transformers does not serialize the implementation name, so saved configs stay clean.
    """
    return f"{ATTENTION_NAME}{_ORIGINAL_SEPARATOR}{original.encode().hex()}"


def is_shared_prefix_name(name) -> bool:
    """Whether ``name`` (a config's ``_attn_implementation``) selects the shared-prefix function."""
    return isinstance(name, str) and name.startswith(ATTENTION_NAME)


def original_implementation_name(config) -> str:
    """The implementation name to fall back to for plain forwards of the model that owns ``config``."""
    name = config._attn_implementation
    if not is_shared_prefix_name(name):
        return name or "eager"
    encoded = name[len(ATTENTION_NAME) + len(_ORIGINAL_SEPARATOR) :]
    return bytes.fromhex(encoded).decode() if encoded else "sdpa"


def intercepting(original):
    """A registry entry that runs ``original`` (a transformers attention implementation such as sdpa or
    flash_attention_2) untouched, except in calls that carry a phase context, which go to
    :func:`shared_prefix_attention`.

    Installed under the implementation's own name, so a model keeps its implementation, its name and its mask
    handling for plain forwards and ``generate``, while the library's phases (and their activation-checkpoint
    recomputations in backward, which look the function up again) reach the shared-prefix attention.
    """
    if getattr(original, "_shared_prefix_original", None) is not None:
        return original

    def attention(module, query, key, value, attention_mask, **kwargs):
        if kwargs.get(CONTEXT_KWARG) is None:
            return original(module, query, key, value, attention_mask, **kwargs)
        return shared_prefix_attention(module, query, key, value, attention_mask, **kwargs)

    attention._shared_prefix_original = original
    return attention


def _original_attention(module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = original_implementation_name(module.config)
    if name == "eager" or name not in ALL_ATTENTION_FUNCTIONS:
        # "eager" is each modeling file's own function, not an interface entry.
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def shared_prefix_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers attention-interface entry point; see the module docstring for the dispatch."""
    handle = kwargs.pop(CONTEXT_KWARG, None)
    if handle is None:
        return _original_attention(module)(module, query, key, value, attention_mask, **kwargs)
    return _phase_attention(module, query, key, value, attention_mask, handle, kwargs)


@torch.compiler.disable
def _phase_attention(module, query, key, value, attention_mask, handle, kwargs):
    """The attention of a phase forward, run eagerly even inside a ``torch.compile``d model or layer.

    It reads and fills the phase context (masks cached per phase, keys/values recorded per layer, routes whose
    backward reads gradients stored by another node), which a traced graph would freeze at its first call: dynamo
    breaks the graph here instead, so the model's projections, RoPE and MLP stay compiled around an exact attention.
    """
    context = handle.context if isinstance(handle, PhaseHandle) else handle
    if context is None:
        return _original_attention(module)(module, query, key, value, attention_mask, **kwargs)
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes `{name}` to its attention; the shared-prefix path does not support it"
            )
    if context.needs_grad and not torch.is_grad_enabled():
        raise ReentrantCheckpointError(
            "a decoder layer ran with gradients disabled although the caller needs them: this is what reentrant "
            "activation checkpointing does, and it would silently drop the gradient through the shared prompt. "
            "Enable checkpointing with gradient_checkpointing_kwargs={'use_reentrant': False}."
        )
    scaling = kwargs.get("scaling")
    if scaling is None:
        scaling = module.head_dim**-0.5
    options = dict(
        scaling=scaling,
        softcap=kwargs.get("softcap"),
        dropout=kwargs.get("dropout", 0.0) if module.training else 0.0,
        sinks=_sink_logits(module, kwargs.get("s_aux"), query),
    )
    window = _sliding_window(module, kwargs)
    if isinstance(context, TreeContext):
        return tree_attention(module, query, key, value, context, window, options), None
    _check_single_call(module, context)
    if isinstance(context, CaptureContext):
        if context.packed == "flash":
            output = flash.capture_attention(module, query, key, value, context, window, options)
        elif context.packed:
            output = flex.packed_capture_attention(query, key, value, context, window, options)
        else:
            output = expand.capture_attention(query, key, value, context, window, options)
        if context.finished:
            # An activation-checkpoint recomputation during backward: the first recording is the one Phase 2 built
            # its graph on; the recomputed keys/values only refill that graph's saved tensors.
            return output, None
        box = context.routes[module] = RouteBox()
        # The keys/values leave the layer on its output, so wrappers see their gradient arrive there; capture_prefix
        # releases them into ``context.kv`` after the forward.
        return attach(output, box, key, value), None
    if isinstance(context, SharedContext):
        if context.packed == "flash":
            return flash.shared_attention(module, query, key, value, context, window, options), None
        if context.packed:
            return flex.packed_shared_attention(module, query, key, value, context, window, options), None
        return expand.shared_attention(module, query, key, value, context, window, options), None
    raise TypeError(f"{CONTEXT_KWARG} must be a CaptureContext or SharedContext, got {type(context).__name__}")


def _check_single_call(module, context) -> None:
    """Refuse an attention module that runs twice in one forward (a layer object repeated in the layer list).

    Keys/values are recorded and looked up per module; a second pass of the same module would reuse the first
    pass's prefix, and an activation-checkpoint recomputation could not tell which pass it repeats.
    """
    if context.finished:
        return
    seen = context.routes if isinstance(context, CaptureContext) else context.called
    if module in seen:
        raise ValueError(
            f"attention module {type(module).__name__} ran twice in one forward (the same layer object appears more "
            "than once in the model's layers); the shared-prefix path records keys/values per layer and cannot "
            "serve repeated layers"
        )
    if isinstance(context, SharedContext):
        context.called.add(module)


def _sink_logits(module, s_aux, query):
    """The per-head attention-sink logits ``s_aux`` (GPT-OSS) as a (heads,) tensor, or None.

    Only a learned logit per head is understood (a sink column every query adds to its softmax denominator);
    anything shaped otherwise is refused rather than broadcast into something else.
    """
    if s_aux is None:
        return None
    if not isinstance(s_aux, torch.Tensor) or s_aux.dim() != 1 or s_aux.shape[0] != query.shape[1]:
        shape = tuple(s_aux.shape) if isinstance(s_aux, torch.Tensor) else type(s_aux).__name__
        raise ValueError(
            f"{type(module).__name__} passes `s_aux` of shape {shape}; the shared-prefix path supports one attention "
            f"sink logit per head ({query.shape[1]},)"
        )
    return s_aux


def _sliding_window(module, kwargs):
    """The layer's sliding window: the ``sliding_window`` kwarg when the model passes one (even None), else the
    module's attribute. Some models (Qwen2-MoE) apply their window only through the mask transformers builds, which
    the shared path does not use, and record it on the attention module only."""
    if "sliding_window" in kwargs:
        return kwargs["sliding_window"]
    return getattr(module, "sliding_window", None)
