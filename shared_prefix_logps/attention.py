"""The attention function registered with transformers' ``AttentionInterface``.

transformers calls it from every attention layer with post-RoPE ``query`` (batch, heads, q_len, head_dim) and
``key``/``value`` (batch, kv_heads, k_len, head_dim). It dispatches on the phase context passed as a model kwarg:

- no context: the model's original implementation, untouched (generation and plain forwards);
- :class:`CaptureContext`: Phase 1, causal attention over the left-padded prompts, recording keys/values;
- :class:`SharedContext`: Phase 2, completion queries over [group prefix ; own tokens causally].
"""

from __future__ import annotations

import functools
import inspect
import sys

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from . import flex
from .context import CONTEXT_KWARG, CaptureContext, PhaseHandle, SharedContext, cached
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
    _check_single_call(module, context)
    if isinstance(context, CaptureContext):
        if context.packed:
            output = flex.packed_capture_attention(query, key, value, context, window, options)
        else:
            output = _capture_attention(query, key, value, context, window, options)
        if context.finished:
            # An activation-checkpoint recomputation during backward: the first recording is the one Phase 2 built
            # its graph on; the recomputed keys/values only refill that graph's saved tensors.
            return output, None
        box = context.routes[module] = RouteBox()
        # The keys/values leave the layer on its output, so wrappers see their gradient arrive there; capture_prefix
        # releases them into ``context.kv`` after the forward.
        return attach(output, box, key, value), None
    if isinstance(context, SharedContext):
        if context.packed:
            return flex.packed_shared_attention(module, query, key, value, context, window, options), None
        return _shared_expand_attention(module, query, key, value, context, window, options), None
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


def _capture_attention(query, key, value, context: CaptureContext, window, options):
    mask = cached(
        context,
        ("prefix", window, query.dtype),
        lambda: additive_mask(prefix_causal_mask(context, window), query.dtype),
    )
    return masked_attention(query, key, value, mask, **options)


def _shared_expand_attention(module, query, key, value, context: SharedContext, window, options):
    own_mask = cached(context, ("own", window), lambda: own_causal_mask(context, window))
    capture = context.capture
    if capture is None:
        own = cached(context, ("own-additive", window, query.dtype), lambda: additive_mask(own_mask, query.dtype))
        return masked_attention(query, key, value, own, **options)
    prefix_key, prefix_value = capture.kv_of(module)
    rows = context.group_index

    def build():
        own_rows = own_mask.expand(rows.numel(), -1, -1, -1)
        return additive_mask(torch.cat([completion_prefix_mask(context, window), own_rows], dim=-1), query.dtype)

    mask = cached(context, ("shared", window, query.dtype), build)
    return gathered_attention(query, prefix_key, prefix_value, key, value, rows, mask, options)


def gathered_attention(query, prefix_key, prefix_value, key, value, rows, mask, options) -> torch.Tensor:
    """Completion rows attending over [their group's prefix ; their own keys].

    Args:
        query: (rows, heads, C, head_dim); key/value: (rows, kv_heads, C, head_dim) of the rows' own tokens.
        prefix_key/prefix_value: (prompts, kv_heads, P, head_dim), one per prompt; ``rows`` (rows,) int64 gives
            each row's prompt.
        mask: (rows, 1, C, P + C) additive mask in ``query``'s dtype; options: as for :func:`masked_attention`.

    Returns (rows, C, heads, v_head_dim). Each row needs its prompt's keys/values in one tensor, a copy per row
    (G per prompt) in every layer. On the fused-kernel path with gradients those (rows, kv_heads, P + C, head_dim)
    copies are not saved for backward (where they would be held for every layer at once until backward): the
    gather and the attention are recomputed in backward from the prompts' keys/values, one layer at a time.
    """

    def attend(query, prefix_key, prefix_value, key, value):
        keys = torch.cat([prefix_key[rows], key], dim=2)
        values = torch.cat([prefix_value[rows], value], dim=2)
        return masked_attention(query, keys, values, mask, **options)

    tensors = (query, prefix_key, prefix_value, key, value)
    if _fused_path(query) and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return torch.utils.checkpoint.checkpoint(attend, *tensors, use_reentrant=False)
    return attend(*tensors)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean ``mask`` (True where a query may attend) as an additive mask of ``dtype``: 0 or -inf.

    Built once per phase and shared by every layer: given a boolean mask, SDPA's math kernel builds this tensor
    itself in every layer and saves each copy for backward.
    """
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _window_ok(query_positions, key_positions, window):
    # transformers' sliding window keeps key k for query q when q - k < window.
    return (query_positions - key_positions) < window


def prefix_causal_mask(context: CaptureContext, window) -> torch.Tensor:
    """(num_prompts, 1, L, L) bool mask of Phase 1: causal, no padded keys, every query sees at least itself."""
    length = context.key_valid.shape[1]
    idx = torch.arange(length, device=context.key_valid.device)
    mask = (idx[None, :, None] >= idx[None, None, :]) & context.key_valid[:, None, :]
    if window is not None:
        pos = context.positions
        mask = mask & _window_ok(pos[:, :, None], pos[:, None, :], window)
    # Padded queries would otherwise see no key at all and produce NaN that poisons gradients.
    mask = mask | torch.eye(length, dtype=torch.bool, device=mask.device)
    return mask[:, None]


def own_causal_mask(context: SharedContext, window) -> torch.Tensor:
    """(1, 1, C, C) bool mask of a completion row over its own tokens."""
    length = context.positions.shape[1]
    idx = torch.arange(length, device=context.positions.device)
    mask = idx[:, None] >= idx[None, :]
    if window is not None:
        mask = mask & _window_ok(idx[:, None], idx[None, :], window)
    return mask[None, None]


def completion_prefix_mask(context: SharedContext, window) -> torch.Tensor:
    """(rows, 1, C, prefix_len) bool mask of completion queries over their group's prefix keys."""
    capture = context.capture
    rows = context.group_index
    mask = capture.key_valid[rows][:, None, :].expand(-1, context.positions.shape[1], -1)
    if window is not None:
        mask = mask & _window_ok(context.positions[:, :, None], capture.positions[rows][:, None, :], window)
    return mask[:, None]


def masked_attention(query, key, value, mask, *, scaling, softcap, dropout, sinks=None) -> torch.Tensor:
    """Softmax attention under a mask.

    Args:
        query: (batch, heads, q_len, head_dim).
        key: (batch, kv_heads, k_len, head_dim); value: (batch, kv_heads, k_len, v_head_dim) (MLA: v_head_dim may
            differ from head_dim); kv_heads divides heads (grouped-query attention).
        mask: broadcastable to (batch, 1, q_len, k_len); bool (True where a query may attend) or additive in
            ``query``'s dtype (0 where it may, -inf where not). Every query row must be able to attend somewhere.
        scaling: multiplies the scores; softcap: scores -> softcap * tanh(scores / softcap) when not None.
        sinks: (heads,) attention-sink logits or None; each head's sink joins the softmax denominator of every
            query (as one more key whose value is zero), so the weights over real keys sum to less than one.

    Returns:
        (batch, q_len, heads, v_head_dim) in ``query``'s dtype, the layout transformers expects back.
    """
    groups = query.shape[1] // key.shape[1]
    if softcap is None and sinks is None:
        out = _sdpa(query, key, value, mask, dropout=dropout, scale=scaling, groups=groups)
        return out.transpose(1, 2).contiguous()
    # SDPA takes neither a softcap nor sinks: compute the scores explicitly.
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = _softmax_with_sinks(scores, sinks).to(query.dtype)
    if dropout:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


#: Device types on which the expand backend takes its fused-kernel path: SDPA's kernels in the order of
#: :data:`KERNEL_PRIORITY`, KV heads repeated where a mask meets grouped-query attention, and the per-row prefix
#: copies recomputed in backward instead of saved (:func:`gathered_attention`). Tests add "cpu" to check its numbers.
_FUSED_PATH_DEVICES = {"cuda"}

#: SDPA kernels the fused-kernel path allows, most preferred first. A masked attention cannot use flash; the
#: memory-efficient kernel takes masks; math, the last resort, materializes the scores.
KERNEL_PRIORITY = ("EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION", "MATH")


def _fused_path(tensor: torch.Tensor) -> bool:
    return tensor.device.type in _FUSED_PATH_DEVICES


def _sdpa(query, key, value, mask, *, dropout, scale, groups) -> torch.Tensor:
    """F.scaled_dot_product_attention over (batch, heads, q_len, head_dim) queries; (batch, heads, q_len, v_dim)."""
    if not _fused_path(query):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=groups > 1
        )
    if groups > 1 and mask is not None:
        # Flash attention takes no mask and torch 2.11's memory-efficient kernel no GQA: with both, SDPA would fall
        # to the math kernel. Repeated KV heads (a copy of the keys/values, smaller than the scores) let the
        # memory-efficient kernel take the mask.
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        groups = 1
    with _kernel_priority():
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, enable_gqa=groups > 1
        )


def _kernel_priority():
    """``sdpa_kernel`` allowing :data:`KERNEL_PRIORITY`, in that order where torch takes an order (set_priority)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [getattr(SDPBackend, name) for name in KERNEL_PRIORITY if hasattr(SDPBackend, name)]
    if _takes_priority(sdpa_kernel):
        return sdpa_kernel(backends, set_priority=True)
    return sdpa_kernel(backends)


@functools.cache
def _takes_priority(sdpa_kernel) -> bool:
    # set_priority arrived in torch 2.6 or so; without it the list only enables kernels, in torch's own order.
    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """float32 softmax of (batch, heads, q_len, k_len) ``scores`` over keys, with each head's sink logit as one more
    entry of the denominator when ``sinks`` (heads,) is given; the sink's own weight is dropped (as in transformers'
    GPT-OSS eager attention). The sink gets its gradient through the denominator."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    sink = sinks.to(torch.float32).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores.float(), sink], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]
