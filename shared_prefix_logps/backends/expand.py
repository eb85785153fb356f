"""The ``expand`` layout of a node call: each node one row of a padded batch, attending with SDPA over its ancestors'
keys/values (gathered per node from the ancestor store) and causally over its own tokens. The model itself sees the
nodes' tokens packed (no padding forwarded): queries, keys and values are unpacked into rows here and the output
packed back.

Masks: a call whose nodes have no ancestors and no window shorter than their tokens runs causal SDPA without a mask
(kernels skip the key tiles above the diagonal): nodes are left-justified in their rows, so the padding after a
shorter node is never visible to its real queries. A call whose nodes all have as many ancestor tokens (sibling
completions under prompts of one length) shares one (1, 1, Lmax, A + Lmax) mask row among its nodes. Others get one
(S, 1, Lmax, A + Lmax) mask. Each is built once per call and shared by every layer, its last dim allocated rounded up
to a multiple of 16 and passed as a slice, so its row stride is aligned and SDPA's memory-efficient kernel does not
copy it in every layer (and save the copy for backward).

On CUDA (the fused-kernel path) the SDPA kernel is chosen per call signature by asking torch which kernels accept
the call, in torch's own priority order, cuDNN included (``sdpa_kernels``); KV heads are repeated only when the
chosen kernel rejects grouped heads; with gradients the per-node gather is recomputed in backward instead of saved;
softcap/sinks models, whose scores are computed explicitly, are refused above a memory budget.

Memory beyond the model's own activations (A ancestor keys, L node tokens, h query and g KV heads of size d, s bytes
per element; formulas and figures in ``expand_memory``, no-grad chunks of rows sized by them in ``engine/budget``):

- masks: L x pad16(A + L) x s per node, quadratic and G-fold for completions of long prompts (2.1 GiB per prompt at
  P = 16k, G = 64, C = 1k, bf16), or once for all nodes (equal ancestors, no window);
- gathered K/V: 2 x g x (A + L) x d x s per node per layer (recomputed in backward, not saved, on CUDA);
- repeated K/V: 2 x h x (A + L) x d x s per node, only for a kernel that rejects grouped heads;
- explicit scores (softcap, sinks): h x L x (A + L) x (4 + 2s) per node.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from . import sdpa_kernels
from .expand_memory import AttentionShape, check_explicit_scores, padded_width
from .layouts import LayerCall


def cached(cache: dict, key, build):
    """``cache[key]``, built by ``build()`` on first use: a node call's masks depend on the layer only through its
    sliding window, so each is built once per call (``cache`` is the call context's ``masks``)."""
    if key not in cache:
        cache[key] = build()
    return cache[key]


#: The optional node-call fields this layout reads (``layouts.py``): each node's row of the padded batch, its ancestor
#: tokens in the store.
CALL_FIELDS = ("pack_index", "pack_valid", "ancestor_index", "ancestor_valid")


def unavailable(device: torch.device, needs_grad: bool) -> str | None:
    """None: SDPA runs on every device, with gradients or without."""
    return None


def node_attention(query, key, value, layer: LayerCall) -> torch.Tensor:
    """transformers-layout attention output (1, T, heads, v_head_dim) of a node call.

    Args:
        query: (1, heads, T, head_dim); key/value: (1, kv_heads, T, head_dim), post-RoPE, packed.
        layer: the layer's :class:`~.layouts.LayerCall`: ``call`` (``pack_index``, ``pack_valid``, ``ancestor_index``,
            ``ancestor_valid``, ``positions``), ``ancestors``, ``cache`` (the call's masks), ``window``, ``options`` (as
            for :func:`masked_attention`).

    The gathered (S, kv_heads, A + Lmax, head_dim) copies are per node; on the fused-kernel path with gradients they
    are not saved for backward, where every layer's would be held at once: the gather and the attention are
    recomputed in backward from the packed and stored keys/values.
    """
    call, ancestors, cache, window, options = layer.call, layer.ancestors, layer.cache, layer.window, layer.options
    rows, index = call.pack_index, call.ancestor_index
    store = None
    if ancestors:
        store = ancestors[0] if len(ancestors) == 1 else tuple(torch.cat(part, dim=1) for part in zip(*ancestors))
    width = rows.shape[1]
    causal = store is None and window_is_moot(window, width)
    # Every node with as many ancestor tokens and no window: every node's mask row is the same (own padding comes
    # after a node's real tokens, so causality hides it from them).
    uniform = call.same_ancestors and window_is_moot(window, index.shape[1] + width)
    mask = None
    if not causal:
        mask = cached(
            cache, ("expand", window, query.dtype), lambda: node_mask(call, window, query.dtype, shared=uniform)
        )

    # Slots past a node's end (or its ancestors') gather the call's (or the store's) token 0, another node's token.
    # The mask hides them from every query, but attention multiplies a hidden value by its zero weight, and 0 x NaN is
    # NaN: a non-finite state of one row would reach every node padded in the same call, and a padded query computing
    # over NaN would send NaN into the gradients of its node's keys. Selecting zeros there (not multiplying by a 0/1
    # mask, which keeps NaN) keeps a row's non-finite values in its row. Where the padding lies is found once per call,
    # as is each packed token's (row, column), by which the output is gathered back (a boolean mask would make the
    # host read the device in every layer).
    padding = cached(cache, ("padding",), lambda: ~call.pack_valid[:, None, :, None])
    ancestor_padding = cached(cache, ("ancestor-padding",), lambda: ~call.ancestor_valid[:, None, :, None])

    def unpack(tensor):  # (1, h, T, d) -> (S, h, Lmax, d), zeros past each node's end
        return tensor[0][:, rows].transpose(0, 1).masked_fill(padding, 0)

    def ancestors_of(stored):  # (h, A_total, d) -> (S, h, A, d), zeros past each node's ancestors
        return stored[:, index].transpose(0, 1).masked_fill(ancestor_padding, 0)

    def attend(query, key, value, *stored):
        heads, kv_heads = query.shape[1], key.shape[1]
        if query.shape[3] == value.shape[3] and query.dtype == key.dtype == value.dtype:
            # One gather for the queries, keys and values of every node (their head dims agree).
            packed = unpack(torch.cat([query, key, value], dim=1))
            query_rows, keys, values = packed.split([heads, kv_heads, kv_heads], dim=1)
        else:
            query_rows, keys, values = unpack(query), unpack(key), unpack(value)
        if stored:
            keys = torch.cat([ancestors_of(stored[0]), keys], dim=2)
            values = torch.cat([ancestors_of(stored[1]), values], dim=2)
        output = masked_attention(query_rows, keys, values, mask, is_causal=causal, contiguous=False, **options)
        # (S, Lmax, heads, v_head_dim) -> (1, T, heads, v_head_dim): each packed token from its slot.
        return output[call.query_slot, call.query_order][None]

    tensors = (query, key, value, *(store or ()))
    # Only a gather of ancestors is worth recomputing: a call without ancestors copies nothing per node.
    if store is not None and _fused_path(query) and torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return torch.utils.checkpoint.checkpoint(attend, *tensors, use_reentrant=False)
    return attend(*tensors)


def node_mask(call, window, dtype: torch.dtype, shared: bool = False) -> torch.Tensor:
    """(S, 1, Lmax, A + Lmax) additive mask of ``dtype`` (0 or -inf), rows aligned: node queries over [their
    ancestors' tokens ; their own tokens causally]. With ``shared`` (every node with A ancestor tokens, no window)
    the first node's row only, (1, 1, Lmax, A + Lmax), which broadcasts over the nodes.

    Written in place from each query's allowed key range, never as a boolean mask of its full size. Padded query
    rows see their own slot too (a query with no visible key would give NaN that poisons gradients). Sliding windows
    compare positions: a node's ancestor tokens sit at positions 0 .. A - 1 (their columns) and its own follow them.
    """
    rows = slice(0, 1) if shared else slice(None)
    valid, ancestor_valid = call.pack_valid[rows], call.ancestor_valid[rows]
    count, width = valid.shape
    num_ancestors = ancestor_valid.shape[1]
    mask = empty_additive_mask((count, 1, width, num_ancestors + width), dtype, valid.device)
    prefix, own = mask[..., :num_ancestors], mask[..., num_ancestors:]
    if num_ancestors:
        prefix.masked_fill_(~ancestor_valid[:, None, None, :], float("-inf"))
        if window is not None:
            # A node's ancestor tokens sit at positions 0 .. A - 1, its own after them: the first key a query at
            # position q sees is the one at q - window + 1.
            own_positions = ancestor_valid.sum(1, keepdim=True) + torch.arange(width, device=valid.device)
            first = (own_positions - window + 1).clamp(min=0)
            block_outside(prefix, first, torch.full_like(first[:, :1], num_ancestors - 1))
    fill_own_causal(own, window)
    if not shared:
        own.masked_fill_(~valid[:, None, None, :], float("-inf"))
        own.diagonal(dim1=-2, dim2=-1).fill_(0)
    return mask


def window_is_moot(window, length: int) -> bool:
    """Whether a sliding ``window`` hides nothing from a causal query over ``length`` keys (the farthest key of the
    last query is ``length - 1`` positions back)."""
    return window is None or window >= length


def empty_additive_mask(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero mask of ``shape`` whose rows start every :data:`~.expand_memory.MASK_ALIGNMENT` elements.

    The storage's last dim is rounded up and the result is a slice of it: SDPA's memory-efficient kernel copies a
    mask whose strides are not multiples of 8 in every call (``pad_bias``), and under grad saves each copy.
    """
    *leading, width = shape
    return torch.zeros(*leading, padded_width(width), dtype=dtype, device=device)[..., :width]


def fill_own_causal(mask: torch.Tensor, window) -> None:
    """-inf into (batch, 1, C, C) ``mask`` where a token may not see another of its own run (a completion row, a
    prefix-tree node; positions advance by one along it): later tokens, and tokens ``window`` or more back."""
    index = torch.arange(mask.shape[-1], device=mask.device)[None]
    first = torch.zeros_like(index) if window is None else (index - window + 1).clamp(min=0)
    block_outside(mask, first, index)


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
    query, key, value, mask, *, scaling, softcap, dropout, sinks=None, is_causal: bool = False, contiguous: bool = True
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

        contiguous: return a contiguous tensor (else possibly a transposed view, for a caller that gathers from it).

    Returns:
        (batch, q_len, heads, v_head_dim) in ``query``'s dtype, the layout transformers expects back.
    """
    groups = query.shape[1] // key.shape[1]
    if softcap is None and sinks is None:
        out = _sdpa(query, key, value, mask, dropout=dropout, scale=scaling, groups=groups, is_causal=is_causal)
        return out.transpose(1, 2).contiguous() if contiguous else out.transpose(1, 2)
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
#: per-node ancestor copies recomputed in backward instead of saved (:func:`node_attention`), explicit scores
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
    """Whether a no-grad node call of this layout on ``device`` holds a copy of the keys/values per query head: one
    node of ``queries`` tokens over ``keys`` keys with an additive mask (``masked``: a call with ancestors, or a
    window) or causal without one (a call without ancestors).

    The SDPA kernel is chosen as for the real call (:func:`sdpa_kernels.choose` on empty tensors of the call's
    dtype, sizes and layouts: queries and own keys/values unpacked per node from the packed tokens, a call's
    [ancestors ; own] keys/values concatenated, the mask's rows aligned). Heads are repeated for a fused kernel that
    rejects grouped heads, and by the math kernel itself (its ``enable_gqa`` repeats them); a kernel that takes grouped
    heads natively (cuDNN on sm90, the memory-efficient kernel after torch 2.11) holds no copy. Explicit scores
    (softcap, sinks) repeat them always. False off the fused-kernel path and without grouped heads.
    """
    if not on_fused_path(device) or shape.kv_heads == shape.heads:
        return False
    if shape.explicit_scores:
        return True

    def unpacked(heads, length, dim):  # (1, heads, length, dim) as node_attention unpacks it from the packed tokens
        return torch.empty(heads, 1, length, dim, dtype=dtype, device=device).transpose(0, 1)

    query = unpacked(shape.heads, queries, shape.head_dim)
    if masked and queries != keys:  # ancestors and own keys/values concatenated
        key = torch.empty(1, shape.kv_heads, keys, shape.head_dim, dtype=dtype, device=device)
        value = torch.empty(1, shape.kv_heads, keys, shape.v_head_dim, dtype=dtype, device=device)
    else:
        key, value = unpacked(shape.kv_heads, keys, shape.head_dim), unpacked(shape.kv_heads, keys, shape.v_head_dim)
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
