"""The attention function registered with transformers' ``AttentionInterface``.

transformers calls it from every attention layer with post-RoPE ``query`` (batch, heads, q_len, head_dim) and
``key``/``value`` (batch, kv_heads, k_len, head_dim). It dispatches on the context passed as a model kwarg:

- no context: the model's original implementation, untouched (generation and plain forwards);
- a :class:`~.context.NodeContext`: a node call's packed tokens attend over their ancestors' keys/values and causally
  over their own node, computed by the call's layout, looked up in the layout table (``backends/layouts.py``):
  ``expand`` (SDPA over per-node gathered keys), ``flex`` (one ``flex_attention`` call under a mask from the trie's
  structure) or ``flash`` (flash-attn's varlen kernels, one part per ancestor level merged by log-sum-exp). Each
  layer's keys/values leave on its output.

The registry entries transformers looks these functions up under, and the mask builder beside them, are here too.
"""

from __future__ import annotations

import sys

import torch

from ..backends.layouts import LayerCall, layout_module
from .context import CONTEXT_KWARG, ContextHandle, NodeContext, active_context
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
    flash_attention_2) untouched, except in calls that carry a node call's context, which go to
    :func:`shared_prefix_attention`.

    Installed under the implementation's own name, so a model keeps its implementation, its name and its mask
    handling for plain forwards and ``generate``, while the library's node calls (and their activation-checkpoint
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
    return _node_attention(module, query, key, value, attention_mask, handle, kwargs)


@torch.compiler.disable
def _node_attention(module, query, key, value, attention_mask, handle, kwargs):
    """The attention of a node call's forward, run eagerly even inside a ``torch.compile``d model or layer.

    It reads and fills the call's context (masks cached per call, keys/values recorded per layer, routes whose
    backward reads gradients stored by another node), which a traced graph would freeze at its first call: dynamo
    breaks the graph here instead, so the model's projections, RoPE and MLP stay compiled around an exact attention.
    """
    context = handle.context if isinstance(handle, ContextHandle) else handle
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
    if not context.finished and module in context.routes:
        raise ValueError(
            f"attention module {type(module).__name__} ran twice in one forward (the same layer object appears more "
            "than once in the model's layers); the shared-prefix path records keys/values per layer and cannot "
            "serve repeated layers"
        )
    call = context.call
    layer = LayerCall(
        module=module,
        call=call,
        ancestors=context.ancestor_states(module),
        cache=context.masks,
        window=window,
        options=options,
        needs_grad=context.needs_grad,
        non_finite=context.non_finite,
    )
    output = layout_module(context.settings.layout).node_attention(query, key, value, layer)
    if context.finished:
        # An activation-checkpoint recomputation in backward: the recorded keys/values are already in the graph.
        return output, None
    if not call.keeps_states:
        context.routes[module] = None  # no later call attends over this one: nothing to record
        return output, None
    box = context.routes[module] = RouteBox()
    # The keys/values leave the layer on its output, so wrappers see their gradient arrive there; the node call
    # releases them into its outputs after the forward (``engine/model_call.py``).
    return attach(output, box, key[0], value[0]), None


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


def register_eager_name() -> None:
    """Register the name an eager model's config is switched to (the only name the installation writes into a
    config). A prepared model loaded in another process (``torch.load``, multiprocessing, Ray) carries that name in
    its config, and transformers looks it up in the registry on every forward, plain ones included."""
    register(implementation_name("eager"))


def register(name: str) -> None:
    """Register :func:`shared_prefix_attention` and its mask builder under ``name``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, shared_prefix_attention)
    AttentionMaskInterface.register(name, _shared_prefix_mask)


def in_node_call() -> bool:
    """Whether a node call's forward is running (not a plain forward, nor the head check's forward)."""
    return isinstance(active_context(), NodeContext)


def _shared_prefix_mask(*args, config=None, **kwargs):
    """Mask builder registered beside the attention function.

    Inside a node call the attention function builds its own masks from the context, so transformers builds none
    (no rows x keys tensor); outside one the original implementation's mask builder runs.
    """
    if in_node_call():
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = original_implementation_name(config) if config is not None else "sdpa"
    builder = ALL_MASK_ATTENTION_FUNCTIONS[name if name in ("sdpa", "eager") else "sdpa"]
    return builder(*args, config=config, **kwargs)
