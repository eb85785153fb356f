"""A pure-torch implementation of flash-attn's varlen kernels: the same interface and the same conventions.

It is what the ``flash`` layout runs when no flash-attn is installed and the tests substitute it (:data:`REFERENCE`
under :func:`~shared_prefix_logps.backends.flash_kernels.substituted`), and what the GPU tests compare the real kernels
with. Every convention of flash-attn 2.x's ``_flash_attn_varlen_forward``/``_flash_attn_varlen_backward`` that the
``flash`` backend relies on is reproduced:

- packed tensors: queries (total_q, heads, head_dim), keys (total_k, kv_heads, head_dim), values
  (total_k, kv_heads, v_head_dim); sequence ``i`` is rows ``cu_seqlens[i]:cu_seqlens[i + 1]``; kv_heads divides
  heads (query head ``h`` reads KV head ``h // (heads // kv_heads)``);
- ``causal`` aligns the mask to the bottom-right corner: query ``i`` of a sequence with ``Lq`` queries and ``Lk`` keys
  sees key ``j`` when ``j <= i + Lk - Lq``; ``window_left`` >= 0 also hides keys ``j < i + Lk - Lq - window_left``;
- ``softcap`` > 0: scores ``softcap * tanh(scale * q.k / softcap)``;
- the forward returns the output and the log-sum-exp of each query's (scaled, capped) scores as (heads, total_q),
  float32; a query that sees no key gets output 0 and log-sum-exp +inf (so that ``exp(score - lse)`` is 0 for it);
- the backward takes the output and the log-sum-exp, not the probabilities: ``P = exp(S - lse)``,
  ``dS = P * (dO V^T - rowsum(dO * O))``. Given the output and log-sum-exp of a larger softmax (the merge of several
  parts), it returns the gradients of that larger softmax restricted to the part's keys: the identity the cascade
  in ``backends/flash`` rests on.

Scores are computed in float32 (float64 for float64 inputs, whose log-sum-exp is then float64 too, so float64 checks
are not limited by it). Sequences are processed one at a time: this is a reference, not a fast path.
"""

from __future__ import annotations

import torch

from shared_prefix_logps.backends.flash_kernels import VarlenKernels


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(q_start, q_end, k_start, k_end) of every sequence, as Python ints."""
    q_bounds, k_bounds = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(q_bounds) != len(k_bounds):
        raise ValueError(f"cu_seqlens_q ({len(q_bounds)}) and cu_seqlens_k ({len(k_bounds)}) differ in length")
    return [(q_bounds[i], q_bounds[i + 1], k_bounds[i], k_bounds[i + 1]) for i in range(len(q_bounds) - 1)]


def _visible(num_q: int, num_k: int, causal: bool, window_left: int, device) -> torch.Tensor:
    """(num_q, num_k) bool: which keys each query sees (bottom-right aligned causal mask and left window)."""
    q = torch.arange(num_q, device=device)[:, None] + (num_k - num_q)
    k = torch.arange(num_k, device=device)[None, :]
    visible = torch.ones(num_q, num_k, dtype=torch.bool, device=device)
    if causal:
        visible &= k <= q
    if window_left >= 0:
        visible &= k >= q - window_left
    return visible


def _scores(q, k, scale, softcap):
    """(heads, Lq, Lk) capped scores and the tanh of the cap (None without one), in the accumulator dtype."""
    raw = torch.einsum("qhd,khd->hqk", q, k) * scale
    if not softcap:
        return raw, None
    capped = torch.tanh(raw / softcap)
    return softcap * capped, capped


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(L, kv_heads, d) -> (L, heads, d): each KV head repeated for the query heads of its group."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale, causal, window_left=-1, softcap=0.0
):
    """flash-attn's varlen forward: (out (total_q, heads, v_head_dim) in q's dtype, lse (heads, total_q)).

    ``max_seqlen_*`` are accepted for the interface and checked, as the real kernels trust them.
    """
    heads, acc = q.shape[1], _accumulator(q.dtype)
    out = q.new_zeros(q.shape[0], heads, v.shape[2])
    lse = torch.full((heads, q.shape[0]), float("inf"), dtype=acc, device=q.device)
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 - q0 > max_seqlen_q or k1 - k0 > max_seqlen_k:
            raise ValueError("a sequence is longer than max_seqlen_q/max_seqlen_k")
        if q1 == q0 or k1 == k0:
            continue
        scores, _ = _scores(q[q0:q1].to(acc), _repeat_kv(k[k0:k1], heads).to(acc), scale, softcap)
        visible = _visible(q1 - q0, k1 - k0, causal, window_left, q.device)
        scores = scores.masked_fill(~visible, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf where a query sees nothing
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hqk,khd->qhd", probs, _repeat_kv(v[k0:k1], heads).to(acc)).to(q.dtype)
        lse[:, q0:q1] = torch.where(torch.isneginf(row_lse), float("inf"), row_lse)
    return out, lse


def varlen_backward(
    dout,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    *,
    scale,
    causal,
    window_left=-1,
    softcap=0.0,
):
    """flash-attn's varlen backward from the output ``out`` and log-sum-exp ``lse`` (heads, total_q):
    (dq, dk, dv) shaped and typed as q, k, v (dk/dv summed over the query heads of each KV head)."""
    heads, kv_heads, acc = q.shape[1], k.shape[1], _accumulator(q.dtype)
    group = heads // kv_heads
    dq, dk, dv = (torch.zeros_like(t, dtype=acc) for t in (q, k, v))
    # D = rowsum(dO * O), from the output as stored (in q's dtype), as the kernels do.
    delta = (dout.to(acc) * out.to(acc)).sum(-1).transpose(0, 1)  # (heads, total_q)
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        if q1 == q0 or k1 == k0:
            continue
        qs, ks, vs = q[q0:q1].to(acc), _repeat_kv(k[k0:k1], heads).to(acc), _repeat_kv(v[k0:k1], heads).to(acc)
        scores, capped = _scores(qs, ks, scale, softcap)
        visible = _visible(q1 - q0, k1 - k0, causal, window_left, q.device)
        probs = torch.exp(scores - lse[:, q0:q1, None].to(acc)).masked_fill(~visible, 0.0)
        do = dout[q0:q1].to(acc)
        dv_rep = torch.einsum("hqk,qhd->khd", probs, do)
        dp = torch.einsum("qhd,khd->hqk", do, vs)
        ds = probs * (dp - delta[:, q0:q1, None])
        if capped is not None:
            ds = ds * (1 - capped**2)  # d(softcap * tanh(x / softcap)) / dx
        dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, ks) * scale
        dk_rep = torch.einsum("hqk,qhd->khd", ds, qs) * scale
        dk[k0:k1] = dk_rep.unflatten(1, (kv_heads, group)).sum(2)
        dv[k0:k1] = dv_rep.unflatten(1, (kv_heads, group)).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


#: The reference as the kernels the ``flash`` layout calls (any dtype, any head dimension).
REFERENCE = VarlenKernels("the pure-torch reference", varlen_forward, varlen_backward, None, None)
