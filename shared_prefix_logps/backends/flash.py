"""The ``flash`` layout of a node call: flash-attn's varlen kernels over the packed tokens, no masks and no copies per
node.

A node call's queries (its nodes' tokens back to back, nodes in depth-first order) attend over their ancestors at
every level above and causally over their own node. Each is one varlen part, and the parts are merged exactly by
log-sum-exp:

- the own part: a sequence per node, causal (a sliding window is flash-attn's own ``window_size``);
- one part per ancestor level: a sequence per run of nodes that share their ancestor at that level (depth-first
  order puts them together), its queries against that ancestor's keys, not causal. An ancestor's keys/values are
  read in place in the call that forwarded it, never copied per node.

``lse = logsumexp_i(lse_i)`` and ``out = sum_i exp(lse_i - lse) out_i`` (in float32) are the attention over the union
of the keys. The backward needs no gradient of any log-sum-exp: each part's kernel backward, given the *merged*
output and log-sum-exp, returns the gradients of the merged attention over that part's keys (``P_part = exp(S_part -
lse)`` is the merged softmax restricted to the part, and ``D = rowsum(dO * out)`` is the merged one), so the parts'
dq add and their dk/dv are the keys' whole gradients.

Layers it cannot serve exactly go to ``flex`` (same packed layout, same stored keys/values) per layer: attention
sinks, head dimensions the kernels do not take, and layers of a call with ancestors whose sliding window hides keys
(a window cuts into the ancestors of late queries; without ancestors it is flash-attn's own). Where ``flex`` cannot
run either (CPU with gradients) the call is refused with the reason. Dropout is refused.

Memory beyond the model's activations per layer (n packed query tokens, h query heads of size d, s bytes, D parts):
the parts' outputs and float32 log-sum-exps, D x n x h x (d x s + 4), while the layer runs; the merged output and
log-sum-exp, n x h x (d x s + 4), kept for backward. No mask, and no copy of an ancestor per node.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import flash_kernels, flex
from .expand import cached
from .layouts import LayerCall


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
class Part:
    """One part of the merge: its sequences, whether it is causal, flash-attn's left window (-1: none)."""

    seqs: Varlen
    causal: bool
    window_left: int = -1


def merge(outs: list[torch.Tensor], lses: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of disjoint key sets from each set's attention.

    Args:
        outs: (n, heads, v_head_dim) outputs; lses: (heads, n) log-sum-exps (-inf where a part has no key).

    Returns (out (n, heads, v_head_dim) in the first output's dtype, lse (heads, n)), merged in float32 (float64
    for float64).
    """
    acc = torch.promote_types(lses[0].dtype, torch.float32)
    lses = [lse.to(acc) for lse in lses]
    lse = torch.logsumexp(torch.stack(lses), dim=0)
    out = sum(torch.exp(part - lse).transpose(0, 1)[..., None] * o.to(acc) for part, o in zip(lses, outs))
    return out.to(outs[0].dtype), lse


class _MergedAttention(torch.autograd.Function):
    """Packed queries (n, heads, d) over several parts' keys/values (``kv``: key, value of each part in turn), merged
    by log-sum-exp (module docstring)."""

    @staticmethod
    def forward(ctx, q, kernels, parts: list[Part], options: dict, *kv):
        outs, lses = [], []
        for part, k, v in zip(parts, kv[0::2], kv[1::2]):
            s = part.seqs
            out, lse = kernels.forward(
                q, k, v, s.cu_q, s.cu_k, s.max_q, s.max_k, causal=part.causal, window_left=part.window_left, **options
            )
            outs.append(out)
            lses.append(lse)
        out, lse = (outs[0], lses[0]) if len(parts) == 1 else merge(outs, lses)
        ctx.save_for_backward(q, out, lse, *kv)
        ctx.kernels, ctx.parts, ctx.options = kernels, parts, options
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *kv = ctx.saved_tensors
        dout = dout.contiguous()
        dq, grads = None, []
        for part, k, v in zip(ctx.parts, kv[0::2], kv[1::2]):
            s = part.seqs
            dq_part, dk, dv = ctx.kernels.backward(
                dout, q, k, v, out, lse, s.cu_q, s.cu_k, s.max_q, s.max_k,
                causal=part.causal, window_left=part.window_left, **ctx.options,
            )  # fmt: skip
            dq = dq_part if dq is None else dq + dq_part
            grads += [dk, dv]
        return dq, None, None, None, *grads


def _packed(x: torch.Tensor) -> torch.Tensor:
    """(1, heads, n, d) -> (n, heads, d), the varlen layout."""
    return x[0].transpose(0, 1)


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


def _flex_reason(kernels, query, value, options, call, cache, window) -> str | None:
    """Why a layer goes to flex instead of flash-attn, or None."""
    if options.get("sinks") is not None:
        return "its attention sinks (flash-attn's varlen kernels take none)"
    reason = kernels.head_dim_refusal(query, value)
    if reason is None and window is not None and call.levels:
        top = cached(cache, ("flash-top-position",), lambda: int(call.positions.max()))
        if top >= window:  # transformers keeps key k for query q when q - k < window; ancestors start at 0
            reason = f"its sliding window of {window} hides keys of the ancestors"
    return reason


#: The optional node-call fields this layout reads (``layouts.py``): the call's queries in runs per ancestor level.
#: (Layers it hands to ``flex`` read nothing more.)
CALL_FIELDS = ("pack_valid", "levels")


def unavailable(device: torch.device, needs_grad: bool) -> str | None:
    """Why ``backend='flash'`` cannot run on ``device`` (None: it can): flash-attn's varlen kernels must be there
    (installed, or substituted). Layers it hands to ``flex`` are checked when they run."""
    return None if available(device) else unavailable_reason(device)


def node_attention(query, key, value, layer: LayerCall):
    """(1, T, heads, v_head_dim) for a node call's packed (1, heads, T, head_dim) queries and (1, kv_heads, T,
    head_dim) keys; ``layer`` as for :func:`.flex.node_attention`."""
    call, ancestors, cache, window, options = layer.call, layer.ancestors, layer.cache, layer.window, layer.options
    kernels = _kernels(query)
    reason = _flex_reason(kernels, query, value, options, call, cache, window)
    if reason is not None:
        return flex.node_attention(query, key, value, layer)
    parts, kv = [], []
    own = cached(cache, ("flash-own",), lambda: Varlen.of(*(call.pack_valid.sum(1),) * 2))
    own_window = -1
    if window is not None and cached(cache, ("flash-top-position",), lambda: int(call.positions.max())) >= window:
        own_window = window - 1
    parts.append(Part(own, causal=True, window_left=own_window))
    kv += [_packed(key), _packed(value)]
    for level, spec in enumerate(call.levels or ()):
        seqs, select = cached(cache, ("flash-level", level), lambda spec=spec: _level(spec, ancestors))
        parts.append(Part(seqs, causal=False))
        kv += list(select(ancestors))
    out = _MergedAttention.apply(_packed(query), kernels, parts, _kernel_options(options), *kv)
    return out[None].contiguous()


def _level(spec, ancestors):
    """The sequences of one ancestor level and how to take its keys/values from the source calls' (a slice of one
    source where its ancestors' tokens lie there back to back, the usual case; else a gather)."""
    seqs = Varlen.of(spec.query_counts, spec.key_counts)
    sizes = torch.tensor([k.shape[1] for k, _ in ancestors])
    ends = torch.cumsum(sizes, 0).tolist()
    tokens = spec.key_tokens
    first, last = int(tokens[0]), int(tokens[-1])
    contiguous = last - first + 1 == tokens.numel() and bool((tokens[1:] - tokens[:-1] == 1).all())
    source = next(i for i, end in enumerate(ends) if first < end)
    offset = ends[source] - int(sizes[source])
    if contiguous and last < ends[source]:
        start, stop = first - offset, last - offset + 1

        def select(ancestors):
            k, v = ancestors[source]
            return k[:, start:stop].transpose(0, 1), v[:, start:stop].transpose(0, 1)

        return seqs, select

    def gather(ancestors):
        k, v = (torch.cat(part, dim=1) if len(part) > 1 else part[0] for part in zip(*ancestors))
        return k[:, tokens].transpose(0, 1), v[:, tokens].transpose(0, 1)

    return seqs, gather
