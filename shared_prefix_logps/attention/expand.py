"""The ``expand`` backend: each completion row attends over [its prompt's keys/values ; its own keys] with SDPA.

Phase 1 runs causal attention over the left-padded prompts; Phase 2 gathers each row's prompt keys/values (a copy
per row) and attends with one additive mask per phase, shared by every layer. On CUDA the fused kernels are put
first (memory-efficient, flash, cuDNN before math), GQA heads are repeated when a mask is given (no fused kernel
takes both), and with gradients the per-row gather is recomputed in backward instead of saved.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..context import CaptureContext, SharedContext, cached


def capture_attention(query, key, value, context: CaptureContext, window, options):
    mask = cached(
        context,
        ("prefix", window, query.dtype),
        lambda: additive_mask(prefix_causal_mask(context, window), query.dtype),
    )
    return masked_attention(query, key, value, mask, **options)


def shared_attention(module, query, key, value, context: SharedContext, window, options):
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
