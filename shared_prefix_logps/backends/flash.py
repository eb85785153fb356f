"""The ``flash`` backend: flash-attn's varlen kernels over the packed layout, no masks and no copies.

Both phases use the packed layout of ``flex`` (the real prefix tokens of all prompts back to back; the valid query
tokens of all completions back to back). Phase 1 is one causal varlen call, a sequence per prompt. Phase 2 is a
two-part cascade, exact by a log-sum-exp merge:

1. every prompt's completion queries (G rows of C tokens) against the prompt's prefix keys, not causal: one varlen
   sequence per prompt, so the prefix keys/values are read in place, never copied per row;
2. every row's queries against its own keys, causal: one varlen sequence per row.

``lse = logaddexp(lse_1, lse_2)`` and ``out = exp(lse_1 - lse) out_1 + exp(lse_2 - lse) out_2`` (in float32) are
the attention over the union of the keys. The backward needs no gradient of either log-sum-exp: each part's kernel
backward, given the *merged* output and log-sum-exp, returns the gradients of the merged attention over that part's
keys (``P_part = exp(S_part - lse)`` is the merged softmax restricted to the part, and ``D = rowsum(dO * out)`` is
the merged one), so the parts' dq add and their dk/dv are the keys' whole gradients.

Layers it cannot serve exactly go to ``flex`` (same packed layout, same captured keys/values) per layer: attention
sinks, head dimensions the kernels do not take, and Phase 2 layers whose sliding window hides keys (a window cuts
into the prefix of late queries; Phase 1 windows are flash-attn's own ``window_size``). Where ``flex`` cannot run
either (CPU with gradients) the call is refused with the reason. Dropout is refused.

Memory beyond the model's activations per layer (n packed query tokens, h query heads of size d, s bytes): the two
parts' outputs and float32 log-sum-exps, 2 x n x h x (d x s + 4), while the layer runs; the merged output and
log-sum-exp, n x h x (d x s + 4), kept for backward. No mask, and no copy of a prefix per row or per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..forward.context import CaptureContext, SharedContext, cached
from . import flash_kernels, flex


def available(device: torch.device) -> bool:
    """Whether ``backend='flash'`` can run on ``device`` (kernels installed, or substituted)."""
    return flash_kernels.kernels_for(device) is not None


def unavailable_reason(device: torch.device) -> str:
    """Why ``backend='flash'`` cannot run on ``device``."""
    return flash_kernels.unavailable_reason(device)


@dataclass(frozen=True)
class Varlen:
    """The sequences of one varlen call: ``cu_q``/``cu_k`` (sequences + 1,) int32 offsets, their longest lengths."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @classmethod
    def of(cls, q_counts: torch.Tensor, k_counts: torch.Tensor) -> Varlen:
        """From (sequences,) int64 token counts of the queries and of the keys."""

        def offsets(counts):
            return F.pad(counts.cumsum(0), (1, 0)).to(torch.int32)

        def longest(counts):
            return int(counts.max()) if counts.numel() else 0

        return cls(offsets(q_counts), offsets(k_counts), longest(q_counts), longest(k_counts))


@dataclass(frozen=True)
class CascadePlan:
    """How Phase 2's packed queries split into the cascade's two parts (built once per phase).

    Attributes:
        prefix: part 1, a sequence per prompt: its queries (grouped) over its prefix keys.
        own: part 2, a sequence per row: its queries over its own keys.
        by_prompt: (n,) int64 permutation putting the packed queries in prompt order, None when they already are
            (rows of a prompt consecutive, prompts ascending); ``restore`` its inverse.
        has_prefix: (n,) bool, False for queries of a prompt with no prefix key (one-token prompts), whose part 1
            is empty (flash-attn returns log-sum-exp +inf for it, which must not enter the merge).
    """

    prefix: Varlen
    own: Varlen
    by_prompt: torch.Tensor | None
    restore: torch.Tensor | None
    has_prefix: torch.Tensor


def cascade_plan(query_rows, group_index, prefix_segments, num_rows: int) -> CascadePlan:
    """The plan of packed queries owned by ``query_rows`` (n,) int64 (ascending), rows' prompts ``group_index``
    (rows,) int64, and packed prefix keys owned by prompts ``prefix_segments`` (m,) int64 (ascending)."""
    query_prompts = group_index[query_rows]
    num_prompts = max(_count(prefix_segments), _count(group_index))
    prefix_counts = torch.bincount(prefix_segments, minlength=num_prompts)
    prefix = Varlen.of(torch.bincount(query_prompts, minlength=num_prompts), prefix_counts)
    row_counts = torch.bincount(query_rows, minlength=num_rows)
    own = Varlen.of(row_counts, row_counts)
    by_prompt = restore = None
    if query_prompts.numel() > 1 and not bool((query_prompts[1:] >= query_prompts[:-1]).all()):
        by_prompt = torch.argsort(query_prompts, stable=True)
        restore = torch.argsort(by_prompt)
    return CascadePlan(prefix, own, by_prompt, restore, prefix_counts[query_prompts] > 0)


def _count(ids: torch.Tensor) -> int:
    return int(ids.max()) + 1 if ids.numel() else 0


def merge(out_1, lse_1, out_2, lse_2):
    """The attention over the union of two disjoint key sets from each set's attention.

    Args:
        out_1, out_2: (n, heads, v_head_dim) outputs; lse_1, lse_2: (heads, n) log-sum-exps (-inf where a part has
            no key).

    Returns (out (n, heads, v_head_dim) in out_1's dtype, lse (heads, n)), merged in float32 (float64 for float64).
    """
    acc = torch.promote_types(lse_1.dtype, torch.float32)
    lse_1, lse_2 = lse_1.to(acc), lse_2.to(acc)
    lse = torch.logaddexp(lse_1, lse_2)
    weight_1 = torch.exp(lse_1 - lse).transpose(0, 1)[..., None]
    weight_2 = torch.exp(lse_2 - lse).transpose(0, 1)[..., None]
    out = weight_1 * out_1.to(acc) + weight_2 * out_2.to(acc)
    return out.to(out_1.dtype), lse


class _VarlenAttention(torch.autograd.Function):
    """One varlen call (Phase 1, or Phase 2 without any prefix) with the kernels' own backward."""

    @staticmethod
    def forward(ctx, q, k, v, kernels, seqs: Varlen, options: dict):
        out, lse = kernels.forward(q, k, v, seqs.cu_q, seqs.cu_k, seqs.max_q, seqs.max_k, **options)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.kernels, ctx.seqs, ctx.options = kernels, seqs, options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        s = ctx.seqs
        grads = ctx.kernels.backward(dout, q, k, v, out, lse, s.cu_q, s.cu_k, s.max_q, s.max_k, **ctx.options)
        return *grads, None, None, None


class _CascadeAttention(torch.autograd.Function):
    """Phase 2's two-part cascade (module docstring): packed queries (n, heads, d) over their prompt's packed prefix
    keys/values (m, kv_heads, d) and their own keys/values (n, kv_heads, d)."""

    @staticmethod
    def forward(ctx, q, k, v, prefix_k, prefix_v, kernels, plan: CascadePlan, options: dict):
        p = plan.prefix
        q_1 = q if plan.by_prompt is None else q[plan.by_prompt]
        out_1, lse_1 = kernels.forward(
            q_1, prefix_k, prefix_v, p.cu_q, p.cu_k, p.max_q, p.max_k, causal=False, **options
        )
        if plan.restore is not None:
            out_1, lse_1 = out_1[plan.restore], lse_1[:, plan.restore]
        lse_1 = lse_1.masked_fill(~plan.has_prefix, float("-inf"))
        out_1 = out_1.masked_fill(~plan.has_prefix[:, None, None], 0.0)
        o = plan.own
        out_2, lse_2 = kernels.forward(q, k, v, o.cu_q, o.cu_k, o.max_q, o.max_k, causal=True, **options)
        out, lse = merge(out_1, lse_1, out_2, lse_2)
        ctx.save_for_backward(q, k, v, prefix_k, prefix_v, out, lse)
        ctx.kernels, ctx.plan, ctx.options = kernels, plan, options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, prefix_k, prefix_v, out, lse = ctx.saved_tensors
        kernels, plan, options = ctx.kernels, ctx.plan, ctx.options
        dout = dout.contiguous()
        # Both parts' backward from the merged output and log-sum-exp: the merged softmax restricted to each part.
        o = plan.own
        dq, dk, dv = kernels.backward(dout, q, k, v, out, lse, o.cu_q, o.cu_k, o.max_q, o.max_k, causal=True, **options)
        p = plan.prefix
        if plan.by_prompt is None:
            q_1, dout_1, out_1, lse_1 = q, dout, out, lse
        else:
            index = plan.by_prompt
            q_1, dout_1, out_1, lse_1 = q[index], dout[index], out[index], lse[:, index]
        dq_1, d_prefix_k, d_prefix_v = kernels.backward(
            dout_1, q_1, prefix_k, prefix_v, out_1, lse_1, p.cu_q, p.cu_k, p.max_q, p.max_k, causal=False, **options
        )
        dq = dq + (dq_1 if plan.restore is None else dq_1[plan.restore])
        return dq, dk, dv, d_prefix_k, d_prefix_v, None, None, None


def _packed(x: torch.Tensor) -> torch.Tensor:
    """(1, heads, n, d) -> (n, heads, d), the varlen layout."""
    return x[0].transpose(0, 1)


def _unpacked(x: torch.Tensor) -> torch.Tensor:
    """(n, heads, d) -> (1, n, heads, d), the layout transformers expects back."""
    return x[None].contiguous()


def _window_hides(window, positions: torch.Tensor, context) -> bool:
    """Whether a sliding ``window`` hides any key from a phase whose queries sit at ``positions`` (keys start at
    position 0; transformers keeps key k for query q when q - k < window)."""
    if window is None:
        return False
    top = cached(context, ("flash-top-position",), lambda: int(positions.max()) if positions.numel() else 0)
    return top >= window


def _kernel_options(options: dict) -> dict:
    if options["dropout"]:
        raise ValueError("the flash backend does not apply attention dropout; use backend='expand'")
    return dict(scale=options["scaling"], softcap=options["softcap"] or 0.0)


def _kernels(query) -> flash_kernels.VarlenKernels:
    """The kernels for ``query``'s device and dtype; a clear error when there are none or the dtype is refused (a
    model-wide property: every layer would go elsewhere, which ``backend='flash'`` should not do silently)."""
    kernels = flash_kernels.kernels_for(query.device)
    if kernels is None:
        raise ValueError(flash_kernels.unavailable_reason(query.device))
    reason = kernels.dtype_refusal(query)
    if reason is not None:
        raise ValueError(f"backend='flash': {reason}; run the model in bfloat16/float16, or use backend='flex'")
    return kernels


def _route_reason(kernels, query, value, options) -> str | None:
    """Why a layer goes to flex instead of flash-attn, or None."""
    if options.get("sinks") is not None:
        return "its attention sinks (flash-attn's varlen kernels take none)"
    return kernels.head_dim_refusal(query, value)


def _to_flex(reason: str, query, context) -> None:
    """Refuse a layer flex cannot take either; flex's own checks follow when it can."""
    if context.needs_grad and not flex.backward_available(query.device):
        raise ValueError(
            f"backend='flash' cannot serve a layer ({reason}) and the flex backend it would go to has no backward "
            f"on {query.device.type}; use backend='expand'"
        )


def capture_attention(module, query, key, value, context: CaptureContext, window, options) -> torch.Tensor:
    """Phase 1, packed: each prompt's (1, heads, n, head_dim) queries over its own keys, causally.
    Returns (1, n, heads, v_head_dim)."""
    kernels = _kernels(query)
    reason = _route_reason(kernels, query, value, options)
    if reason is not None:
        _to_flex(f"{type(module).__name__}: {reason}", query, context)
        return flex.packed_capture_attention(query, key, value, context, window, options)
    counts = cached(context, ("flash-prefix",), lambda: torch.bincount(context.segments))
    seqs = cached(context, ("flash-prefix-seqs",), lambda: Varlen.of(counts, counts))
    window_left = window - 1 if _window_hides(window, context.positions, context) else -1
    kernel_options = dict(_kernel_options(options), causal=True, window_left=window_left)
    out = _VarlenAttention.apply(_packed(query), _packed(key), _packed(value), kernels, seqs, kernel_options)
    return _unpacked(out)


def shared_attention(module, query, key, value, context: SharedContext, window, options) -> torch.Tensor:
    """Phase 2, packed: (1, heads, n, head_dim) completion queries over [their prompt's prefix ; their own row,
    causally] by the two-part cascade. Returns (1, n, heads, v_head_dim)."""
    kernels = _kernels(query)
    reason = _route_reason(kernels, query, value, options)
    if reason is None and _window_hides(window, context.positions, context):
        reason = f"its sliding window of {window} hides keys of the prefix"
    if reason is not None:
        _to_flex(f"{type(module).__name__}: {reason}", query, context)
        return flex.packed_shared_attention(module, query, key, value, context, window, options)
    kernel_options = _kernel_options(options)
    q, k, v = _packed(query), _packed(key), _packed(value)
    capture = context.capture
    if capture is None:
        counts = cached(context, ("flash-own",), lambda: torch.bincount(context.query_rows))
        seqs = cached(context, ("flash-own-seqs",), lambda: Varlen.of(counts, counts))
        out = _VarlenAttention.apply(q, k, v, kernels, seqs, dict(kernel_options, causal=True, window_left=-1))
        return _unpacked(out)
    prefix_key, prefix_value = capture.kv_of(module)
    plan = cached(
        context,
        ("flash-cascade",),
        lambda: cascade_plan(context.query_rows, context.group_index, capture.segments, context.group_index.numel()),
    )
    out = _CascadeAttention.apply(
        q, k, v, _packed(prefix_key), _packed(prefix_value), kernels, plan, dict(kernel_options, window_left=-1)
    )
    return _unpacked(out)
