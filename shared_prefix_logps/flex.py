"""The ``flex`` backend: packed layouts and one ``flex_attention`` call per layer.

No padding token is processed and no prefix is copied per completion row. Phase 1 forwards the real prefix tokens
of all prompts as one packed row; Phase 2 forwards the valid query tokens of all completions as one packed row.
Each Phase 2 layer attends over ``[packed prefixes ; packed completions]`` under a block mask built from group,
row and position ids, so blocks that no query needs are skipped.

Lengths are rounded up to a multiple of :data:`LENGTH_BUCKET` inside the attention call (the padded queries see
nothing and are dropped), and the compiled kernel is built with dynamic shapes, so new batch shapes do not
recompile every call. flex_attention's backward exists on CUDA only; on CPU this backend is forward-only.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .context import CaptureContext, SharedContext, cached

#: Packed lengths are padded up to a multiple of this inside the attention call (also flex's default block size).
LENGTH_BUCKET = 128


def flex_available(device: torch.device) -> bool:
    """Whether torch ships flex_attention for this device at all."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return device.type in ("cuda", "cpu")


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def _flex_call(query, key, value, *, block_mask, scale, score_mod, return_lse=False):
    """flex_attention over (1, heads, q_len, head_dim) queries; with ``return_lse`` also the (1, heads, q_len)
    float32 log-sum-exp of each query's scores (natural log)."""
    from torch.nn.attention import flex_attention as flex_module

    fn = _compiled_flex() if query.device.type == "cuda" else flex_module.flex_attention
    enable_gqa = query.shape[1] != key.shape[1]
    options = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    if not return_lse:
        return fn(query, key, value, **options)
    if hasattr(flex_module, "AuxRequest"):
        out, aux = fn(query, key, value, return_aux=flex_module.AuxRequest(lse=True), **options)
        return out, aux.lse
    return fn(query, key, value, return_lse=True, **options)


def _round_up(n: int) -> int:
    return max(LENGTH_BUCKET, -(-n // LENGTH_BUCKET) * LENGTH_BUCKET)


def _pad_ids(ids: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    return F.pad(ids, (0, length - ids.shape[0]), value=fill)


def _pad_seq(x: torch.Tensor, length: int) -> torch.Tensor:
    # (1, heads, n, d) -> (1, heads, length, d)
    return F.pad(x, (0, 0, 0, length - x.shape[2]))


def _block_mask(q_groups, q_rows, q_pos, k_groups, k_rows, k_pos, k_order, q_order, window, q_len, kv_len):
    """BlockMask for queries (q_*) over keys (k_*): same group; prefix keys (row -1) always, own-row keys causally
    (``k_order <= q_order``); and within the sliding window by positions when ``window`` is set."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, h, q_idx, kv_idx):
        same_group = q_groups[q_idx] == k_groups[kv_idx]
        key_row = k_rows[kv_idx]
        visible = (key_row < 0) | ((key_row == q_rows[q_idx]) & (k_order[kv_idx] <= q_order[q_idx]))
        allowed = same_group & visible
        if window is not None:
            allowed = allowed & ((q_pos[q_idx] - k_pos[kv_idx]) < window)
        return allowed

    device = q_groups.device
    return create_block_mask(
        mask_mod, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=device, _compile=device.type == "cuda"
    )


def _score_mod(softcap):
    if softcap is None:
        return None

    def soft_cap(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return soft_cap


def packed_capture_attention(query, key, value, context: CaptureContext, window, options) -> torch.Tensor:
    """Phase 1, packed: causal attention within each prompt's segment. Returns (1, n, heads, head_dim)."""
    n = query.shape[2]
    length = _round_up(n)

    def build():
        order = torch.arange(n, device=query.device)
        groups = _pad_ids(context.segments, length, -1)
        pos = _pad_ids(context.positions[0], length, 0)
        # Inside a segment the keys are the query's own row; order gives causality.
        rows = groups.clone()
        q_groups = _pad_ids(context.segments, length, -2)  # padded queries match no key
        orders = _pad_ids(order, length, length)
        return _block_mask(q_groups, rows, pos, groups, rows, pos, orders, orders, window, length, length)

    mask = cached(context, ("flex-prefix", window), build)
    return _attend(query, key, value, mask, length, n, options)


def packed_shared_attention(module, query, key, value, context: SharedContext, window, options) -> torch.Tensor:
    """Phase 2, packed: completion queries over [their group's packed prefix ; their own row causally]."""
    n = query.shape[2]
    capture = context.capture
    if capture is not None:
        prefix_key, prefix_value = capture.kv_of(module)
        key = torch.cat([prefix_key, key], dim=2)
        value = torch.cat([prefix_value, value], dim=2)
    num_prefix = key.shape[2] - n
    q_len, kv_len = _round_up(n), _round_up(key.shape[2])

    def build():
        device = query.device
        rows = context.query_rows
        groups = context.group_index[rows]
        order = torch.arange(n, device=device)
        pos = context.positions[0]
        if capture is not None:
            k_groups = torch.cat([capture.segments, groups])
            k_rows = torch.cat([torch.full((num_prefix,), -1, device=device, dtype=torch.long), rows])
            k_pos = torch.cat([capture.positions[0], pos])
            k_order = torch.cat([torch.zeros(num_prefix, device=device, dtype=torch.long), order])
        else:
            k_groups, k_rows, k_pos, k_order = groups, rows, pos, order
        return _block_mask(
            _pad_ids(groups, q_len, -2),
            _pad_ids(rows, q_len, -2),
            _pad_ids(pos, q_len, 0),
            _pad_ids(k_groups, kv_len, -1),
            _pad_ids(k_rows, kv_len, -3),
            _pad_ids(k_pos, kv_len, 0),
            _pad_ids(k_order, kv_len, kv_len),
            _pad_ids(order, q_len, 0),
            window,
            q_len,
            kv_len,
        )

    mask = cached(context, ("flex-shared", window), build)
    return _attend(query, key, value, mask, q_len, n, options, kv_len=kv_len)


def _attend(query, key, value, block_mask, q_len, n, options, kv_len=None):
    if options["dropout"]:
        raise ValueError("the flex backend does not apply attention dropout; use backend='expand'")
    kv_len = q_len if kv_len is None else kv_len
    sinks = options.get("sinks")
    out = _flex_call(
        _pad_seq(query, q_len),
        _pad_seq(key, kv_len),
        _pad_seq(value, kv_len),
        block_mask=block_mask,
        scale=options["scaling"],
        score_mod=_score_mod(options["softcap"]),
        return_lse=sinks is not None,
    )
    if sinks is not None:
        out = _apply_sinks(*out, sinks)
    return out[:, :, :n].transpose(1, 2).contiguous()


def _apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Renormalize flex's output for attention sinks (a score_mod cannot add a denominator term).

    ``out`` (1, heads, q_len, v_head_dim) is softmax-weighted over the real keys, whose scores have log-sum-exp
    ``lse`` (1, heads, q_len); a sink logit ``s`` per head adds ``exp(s)`` to the denominator, which scales every
    weight by ``exp(lse) / (exp(lse) + exp(s)) = sigmoid(lse - s)``. Differentiable in ``out``, ``lse`` and ``sinks``.
    """
    factor = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
    return (out.float() * factor[..., None]).to(out.dtype)
