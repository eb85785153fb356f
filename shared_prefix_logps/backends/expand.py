"""The ``expand`` backend: each completion row attends over [its prompt's keys/values ; its own keys] with SDPA.

Phase 1 runs causal attention over the left-padded prompts: an unpadded batch of prompts without a window shorter
than the prompt runs SDPA with ``is_causal=True`` and no mask (kernels skip the key tiles above the diagonal), others
with one additive mask shared by every layer. Phase 2 gathers each row's prompt keys/values (a copy per row) and
attends with one additive mask per phase, shared by every layer: (1, 1, C, L + C) for all rows when no prompt is
padded and there is no window, (rows, 1, C, L + C) otherwise. Every mask is allocated with its last dim rounded up
to a multiple of 16 and passed as a slice, so its row stride is aligned and SDPA's memory-efficient kernel does not
copy it in every layer (and save the copy for backward).

On CUDA (the fused-kernel path) the SDPA kernel is chosen per call signature by asking torch which kernels accept
the call, in torch's own priority order, cuDNN included (``sdpa_kernels``); KV heads are repeated only when the
chosen kernel rejects grouped heads; with gradients the per-row gather is recomputed in backward instead of saved;
softcap/sinks models, whose scores are computed explicitly, are refused above a memory budget.

Memory beyond the model's own activations (L = P - 1 prefix keys, C completion tokens, h query and g KV heads of
size d, s bytes per element; formulas and figures in ``expand_memory``, no-grad scoring batches sized by them in
``token_budget``):

- masks: Phase 1 L x pad16(L) x s per padded prompt (none unpadded); Phase 2 C x pad16(L + C) x s per row, quadratic
  and G-fold (2.1 GiB per prompt at P = 16k, G = 64, C = 1k, bf16), or once for all rows (unpadded, no window);
- gathered K/V: 2 x g x (L + C) x d x s per row per layer (recomputed in backward, not saved, on CUDA);
- repeated K/V: 2 x h x (L + C) x d x s per row, only for a kernel that rejects grouped heads;
- explicit scores (softcap, sinks): h x C x (L + C) x (4 + 2s) per row, h x L x L x (4 + 2s) per prompt.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..forward.context import CaptureContext, SharedContext, cached
from . import sdpa_kernels
from .expand_memory import AttentionShape, check_explicit_scores, padded_width


def capture_attention(query, key, value, context: CaptureContext, window, options):
    """Phase 1: (prompts, heads, L, head_dim) queries over their own prompt's keys, causally; (prompts, L, heads, d)."""
    length = key.shape[2]
    if window_is_moot(window, length) and cached(context, ("unpadded",), lambda: bool(context.key_valid.all())):
        return masked_attention(query, key, value, None, is_causal=True, **options)
    mask = cached(context, ("prefix", window, query.dtype), lambda: prefix_mask(context, window, query.dtype))
    return masked_attention(query, key, value, mask, **options)


def shared_attention(module, query, key, value, context: SharedContext, window, options):
    """Phase 2: (rows, heads, C, head_dim) completion queries over [their prompt's keys ; their own, causally]."""
    capture = context.capture
    if capture is None:
        if window_is_moot(window, key.shape[2]):
            return masked_attention(query, key, value, None, is_causal=True, **options)
        own = cached(context, ("own", window, query.dtype), lambda: own_mask(context, window, query.dtype))
        return masked_attention(query, key, value, own, **options)
    prefix_key, prefix_value = capture.kv_of(module)
    rows = context.group_index
    mask = cached(context, ("shared", window, query.dtype), lambda: shared_mask(context, window, query.dtype))
    return gathered_attention(query, prefix_key, prefix_value, key, value, rows, mask, options)


def window_is_moot(window, length: int) -> bool:
    """Whether a sliding ``window`` hides nothing from a causal query over ``length`` keys (the farthest key of the
    last query is ``length - 1`` positions back)."""
    return window is None or window >= length


def gathered_attention(query, prefix_key, prefix_value, key, value, rows, mask, options) -> torch.Tensor:
    """Completion rows attending over [their group's prefix ; their own keys].

    Args:
        query: (rows, heads, C, head_dim); key/value: (rows, kv_heads, C, head_dim) of the rows' own tokens.
        prefix_key/prefix_value: (prompts, kv_heads, P, head_dim), one per prompt; ``rows`` (rows,) int64 gives
            each row's prompt.
        mask: (rows, 1, C, P + C) additive mask in ``query``'s dtype (one row expanded when every row's is the
            same); options: as for :func:`masked_attention`.

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


def empty_additive_mask(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero mask of ``shape`` whose rows start every :data:`~.expand_memory.MASK_ALIGNMENT` elements.

    The storage's last dim is rounded up and the result is a slice of it: SDPA's memory-efficient kernel copies a
    mask whose strides are not multiples of 8 in every call (``pad_bias``), and under grad saves each copy.
    """
    *leading, width = shape
    return torch.zeros(*leading, padded_width(width), dtype=dtype, device=device)[..., :width]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean ``mask`` (True where a query may attend) as an additive mask of ``dtype``: 0 or -inf, rows
    aligned (:func:`empty_additive_mask`).

    Built once per phase and shared by every layer: given a boolean mask, SDPA's math kernel builds this tensor
    itself in every layer and saves each copy for backward.
    """
    return empty_additive_mask(mask.shape, dtype, mask.device).masked_fill_(~mask, float("-inf"))


def prefix_mask(context: CaptureContext, window, dtype: torch.dtype) -> torch.Tensor:
    """Phase 1's additive mask of ``dtype``, (num_prompts, 1, L, L), rows aligned: causal, no padded keys, keys
    within the window, and every query sees at least itself (a padded query would otherwise see no key at all and
    produce NaN that poisons gradients)."""
    key_valid, positions = context.key_valid, context.positions
    length = key_valid.shape[1]
    mask = empty_additive_mask((key_valid.shape[0], 1, length, length), dtype, key_valid.device)
    mask.masked_fill_(~key_valid[:, None, None, :], float("-inf"))
    index = torch.arange(length, device=key_valid.device)[None]
    block_outside(mask, window_start(positions, positions, window), index)
    mask.diagonal(dim1=-2, dim2=-1).fill_(0)
    return mask


def own_mask(context: SharedContext, window, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, C, C) additive mask of ``dtype`` of a completion row over its own tokens, rows aligned."""
    length = context.positions.shape[1]
    mask = empty_additive_mask((1, 1, length, length), dtype, context.positions.device)
    fill_own_causal(mask, window)
    return mask


def shared_mask(context: SharedContext, window, dtype: torch.dtype) -> torch.Tensor:
    """Phase 2's additive mask of ``dtype``, rows aligned: (rows, 1, C, L + C), or (1, 1, C, L + C) expanded over the
    rows when every prefix key is valid and no window hides a key (the mask is then the same for every row).

    Written in place, part by part and query rows by chunks, so no (rows, 1, C, L + C) temporary exists beside it.
    """
    capture = context.capture
    rows = context.group_index
    prefix_len, length = capture.key_valid.shape[1], context.positions.shape[1]
    shared_by_rows = window_is_moot(window, prefix_len + length) and bool(capture.key_valid.all())
    batch = 1 if shared_by_rows else rows.numel()
    mask = empty_additive_mask((batch, 1, length, prefix_len + length), dtype, context.positions.device)
    fill_own_causal(mask[..., prefix_len:], window)
    if shared_by_rows:
        return mask.expand(rows.numel(), -1, -1, -1)
    prefix = mask[..., :prefix_len]
    prefix.masked_fill_(~capture.key_valid[rows][:, None, None, :], float("-inf"))
    if window is not None:
        first = window_start(context.positions, capture.positions[rows], window)
        block_outside(prefix, first, torch.full_like(first[:, :1], prefix_len - 1))
    return mask


def fill_own_causal(mask: torch.Tensor, window) -> None:
    """-inf into (batch, 1, C, C) ``mask`` where a token may not see another of its own run (a completion row, a
    prefix-tree node; positions advance by one along it): later tokens, and tokens ``window`` or more back."""
    index = torch.arange(mask.shape[-1], device=mask.device)[None]
    first = torch.zeros_like(index) if window is None else (index - window + 1).clamp(min=0)
    block_outside(mask, first, index)


def window_start(query_positions, key_positions, window) -> torch.Tensor:
    """(n, Q) int64: the index of the first key each query may see under a sliding ``window`` (transformers keeps
    key k for query q when q - k < window), or zeros (1, Q) without a window. ``key_positions`` (n, K) must be
    non-decreasing along each row (left padding repeats position 0), so the keys a window hides come first."""
    if window is None:
        return torch.zeros_like(query_positions[:1])
    return torch.searchsorted(key_positions.contiguous(), (query_positions - window).contiguous(), right=True)


#: Most elements of each boolean temporary a mask is filled with: query rows are filled in chunks of this size.
_FILL_CHUNK_ELEMENTS = 2**26


def block_outside(mask: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> None:
    """-inf into ``mask`` (n, 1, Q, K) wherever key index j < first[., q] or j > last[., q]; ``first`` and ``last``
    (n or 1, Q or 1) int64. Query rows go in chunks, so the boolean temporaries stay under
    :data:`_FILL_CHUNK_ELEMENTS` elements."""
    batch, _, queries, keys = mask.shape
    index = torch.arange(keys, device=mask.device)
    step = max(1, _FILL_CHUNK_ELEMENTS // max(batch * keys, 1))
    for start in range(0, queries, step):
        lo = first[:, start : start + step, None] if first.shape[1] > 1 else first[:, :, None]
        hi = last[:, start : start + step, None] if last.shape[1] > 1 else last[:, :, None]
        mask[:, 0, start : start + step].masked_fill_((index < lo) | (index > hi), float("-inf"))


def masked_attention(
    query, key, value, mask, *, scaling, softcap, dropout, sinks=None, is_causal: bool = False
) -> torch.Tensor:
    """Softmax attention under a mask.

    Args:
        query: (batch, heads, q_len, head_dim).
        key: (batch, kv_heads, k_len, head_dim); value: (batch, kv_heads, k_len, v_head_dim) (MLA: v_head_dim may
            differ from head_dim); kv_heads divides heads (grouped-query attention).
        mask: broadcastable to (batch, 1, q_len, k_len); bool (True where a query may attend) or additive in
            ``query``'s dtype (0 where it may, -inf where not). Every query row must be able to attend somewhere.
            None with ``is_causal`` (q_len == k_len): query i sees keys 0..i.
        scaling: multiplies the scores; softcap: scores -> softcap * tanh(scores / softcap) when not None.
        sinks: (heads,) attention-sink logits or None; each head's sink joins the softmax denominator of every
            query (as one more key whose value is zero), so the weights over real keys sum to less than one.

    Returns:
        (batch, q_len, heads, v_head_dim) in ``query``'s dtype, the layout transformers expects back.
    """
    groups = query.shape[1] // key.shape[1]
    if softcap is None and sinks is None:
        out = _sdpa(query, key, value, mask, dropout=dropout, scale=scaling, groups=groups, is_causal=is_causal)
        return out.transpose(1, 2).contiguous()
    # SDPA takes neither a softcap nor sinks: compute the scores explicitly.
    if _fused_path(query):
        check_explicit_scores(query, key.shape[2])
    if mask is None and is_causal:
        mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
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


#: Device types on which the expand backend takes its fused-kernel path: the SDPA kernel chosen by asking torch
#: which accepts the call (``sdpa_kernels``), KV heads repeated only for a kernel that rejects grouped heads, the
#: per-row prefix copies recomputed in backward instead of saved (:func:`gathered_attention`), explicit scores
#: refused above a budget. Tests add "cpu" to run it, and its checks of CUDA's rules, on CPU.
_FUSED_PATH_DEVICES = {"cuda"}


def _fused_path(tensor: torch.Tensor) -> bool:
    return on_fused_path(tensor.device)


def on_fused_path(device: torch.device) -> bool:
    """Whether the expand backend takes its fused-kernel path on ``device``."""
    return torch.device(device).type in _FUSED_PATH_DEVICES


def repeats_kv_heads(
    shape: AttentionShape, device: torch.device, dtype: torch.dtype, queries: int, keys: int, *, masked: bool
) -> bool:
    """Whether a no-grad call of this backend on ``device`` holds a copy of the keys/values per query head: one row
    of ``queries`` over ``keys`` with an additive mask (``masked``: every Phase 2 call, a padded or windowed Phase 1)
    or causal without one (an unpadded Phase 1).

    The SDPA kernel is chosen as for the real call (:func:`sdpa_kernels.choose` on empty tensors of the call's
    dtype, sizes and layouts: queries and Phase 1 keys/values in the projections' transposed layout, Phase 2
    keys/values concatenated, the mask's rows aligned). Heads are repeated for a fused kernel that rejects grouped
    heads, and by the math kernel itself (its ``enable_gqa`` repeats them); a kernel that takes grouped heads natively
    (cuDNN on sm90, the memory-efficient kernel after torch 2.11) holds no copy. Explicit scores (softcap, sinks)
    repeat them always. False off the fused-kernel path and without grouped heads.
    """
    if not on_fused_path(device) or shape.kv_heads == shape.heads:
        return False
    if shape.explicit_scores:
        return True

    def projected(heads, length, dim):  # (1, heads, length, dim) as transformers' projections lay it out
        return torch.empty(1, length, heads, dim, dtype=dtype, device=device).transpose(1, 2)

    query = projected(shape.heads, queries, shape.head_dim)
    if masked and queries != keys:  # Phase 2: [gathered prefix ; own] concatenated
        key = torch.empty(1, shape.kv_heads, keys, shape.head_dim, dtype=dtype, device=device)
        value = torch.empty(1, shape.kv_heads, keys, shape.v_head_dim, dtype=dtype, device=device)
    else:
        key, value = projected(shape.kv_heads, keys, shape.head_dim), projected(shape.kv_heads, keys, shape.v_head_dim)
    mask = empty_additive_mask((1, 1, queries, keys), dtype, device) if masked else None
    with torch.no_grad():
        choice = sdpa_kernels.choose(query, key, value, mask, dropout=0.0, is_causal=not masked)
    return choice.repeat_kv or choice.kernel == "MATH"


def _sdpa(query, key, value, mask, *, dropout, scale, groups, is_causal) -> torch.Tensor:
    """F.scaled_dot_product_attention over (batch, heads, q_len, head_dim) queries; (batch, heads, q_len, v_dim)."""

    def call(key, value, groups):
        return F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=dropout,
            scale=scale,
            is_causal=is_causal,
            enable_gqa=groups > 1,
        )

    if not _fused_path(query):
        return call(key, value, groups)
    choice = sdpa_kernels.choose(query, key, value, mask, dropout=dropout, is_causal=is_causal)
    if groups > 1 and choice.repeat_kv:
        # A copy of the keys/values per query head (smaller than the scores the math kernel would build).
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
        groups = 1
    with sdpa_kernels.run_on(choice):
        return call(key, value, groups)


def _softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """float32 softmax of (batch, heads, q_len, k_len) ``scores`` over keys, with each head's sink logit as one more
    entry of the denominator when ``sinks`` (heads,) is given; the sink's own weight is dropped (as in transformers'
    GPT-OSS eager attention). The sink gets its gradient through the denominator."""
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32)
    sink = sinks.to(torch.float32).view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    combined = torch.cat([scores.float(), sink], dim=-1)
    return torch.softmax(combined, dim=-1)[..., :-1]
