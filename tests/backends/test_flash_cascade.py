"""The flash backend's kernels in isolation, in float64: the pure-torch varlen reference against plain attention,
and the two-part cascade (prefix part + own causal part, merged by log-sum-exp, backward from the merged output and
log-sum-exp) against plain attention over [prefix ; own tokens causally]."""

from __future__ import annotations

import pytest
import torch

from shared_prefix_logps.backends import flash, flash_reference
from shared_prefix_logps.backends.flash_kernels import REFERENCE


def plain_attention(q, k, v, visible, scale, softcap=0.0):
    """Autograd attention of (n, heads, d) queries over (m, kv_heads, d) keys under a (n, m) bool mask."""
    heads = q.shape[1]
    k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


def varlen_visibility(q_lens, k_lens, causal, window_left):
    """(total_q, total_k) bool of the varlen conventions (block diagonal, bottom-right causal, left window)."""
    blocks = []
    for lq, lk in zip(q_lens, k_lens):
        qi = torch.arange(lq)[:, None] + lk - lq
        kj = torch.arange(lk)[None, :]
        block = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            block &= kj <= qi
        if window_left >= 0:
            block &= kj >= qi - window_left
        blocks.append(block)
    return torch.block_diag(*blocks).bool()


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def tensors(n, m, heads, kv_heads, dim, v_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(m, kv_heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(m, kv_heads, v_dim, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v, torch.randn(n, heads, v_dim, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize(
    "causal, window_left, softcap", [(True, -1, 0.0), (False, -1, 0.0), (True, 2, 0.0), (True, -1, 1.5)]
)
def test_reference_matches_plain_attention_forward_backward(causal, window_left, softcap):
    # Queries fewer than keys in one sequence (bottom-right causal alignment), an empty sequence, GQA 4:2,
    # and a value head size differing from the query/key one.
    q_lens, k_lens = [3, 0, 5, 2], [5, 2, 5, 2]
    q, k, v, dout = tensors(sum(q_lens), sum(k_lens), 4, 2, 6, 5, seed=1)
    visible = varlen_visibility(q_lens, k_lens, causal, window_left)
    expected = plain_attention(q, k, v, visible, 0.4, softcap)
    expected_grads = torch.autograd.grad(expected, (q, k, v), dout)
    options = dict(scale=0.4, causal=causal, window_left=window_left, softcap=softcap)
    args = (offsets(q_lens), offsets(k_lens), max(q_lens), max(k_lens))
    out, lse = flash_reference.varlen_forward(q, k, v, *args, **options)
    assert lse.shape == (4, sum(q_lens)) and lse.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    grads = flash_reference.varlen_backward(dout, q, k, v, out, lse, *args, **options)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_reference_marks_a_query_without_keys_as_flash_attn_does():
    out, lse = flash_reference.varlen_forward(
        *tensors(2, 0, 2, 2, 4, 4, seed=2)[:3], offsets([2]), offsets([0]), 2, 0, scale=1.0, causal=False
    )
    assert (out == 0).all() and torch.isposinf(lse).all()


def cascade_case(seed, *, group_index, prefix_lengths, row_lengths, heads=4, kv_heads=2, dim=8, v_dim=8):
    """Packed tensors of a Phase 2 cascade and the (n, m + n) visibility of plain attention over [prefix ; own]."""
    rows = torch.arange(len(row_lengths)).repeat_interleave(torch.tensor(row_lengths))
    segments = torch.arange(len(prefix_lengths)).repeat_interleave(torch.tensor(prefix_lengths))
    n, m = rows.numel(), segments.numel()
    q, k, v, dout = tensors(n, n, heads, kv_heads, dim, v_dim, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    pk = torch.randn(m, kv_heads, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    pv = torch.randn(m, kv_heads, v_dim, generator=gen, dtype=torch.float64, requires_grad=True)
    group_index = torch.tensor(group_index)
    order = torch.arange(n)
    own = (rows[:, None] == rows[None, :]) & (order[None, :] <= order[:, None])
    prefix = group_index[rows][:, None] == segments[None, :]
    visible = torch.cat([prefix, own], dim=1)
    return (q, k, v, pk, pv, dout), rows, group_index, segments, visible


def run_cascade(case, rows, group_index, segments, softcap=0.0):
    q, k, v, pk, pv, dout = case
    plan = flash.cascade_plan(rows, group_index, segments, group_index.numel())
    out = flash._CascadeAttention.apply(q, k, v, pk, pv, REFERENCE, plan, dict(scale=0.3, softcap=softcap))
    return out, torch.autograd.grad(out, (q, k, v, pk, pv), dout)


def plain_cascade(case, visible, softcap=0.0):
    q, k, v, pk, pv, dout = case
    out = plain_attention(q, torch.cat([pk, k]), torch.cat([pv, v]), visible, 0.3, softcap)
    return out, torch.autograd.grad(out, (q, k, v, pk, pv), dout)


CASES = {
    # Rows of a prompt consecutive, prompts ascending (no permutation), G = 2.
    "sorted": dict(group_index=[0, 0, 1, 1], prefix_lengths=[4, 6], row_lengths=[3, 5, 2, 4]),
    # Rows in any order (compute_logps_concatenated), a row without tokens, a prompt without prefix keys, and a
    # prompt with prefix keys but no query (every completion of it empty).
    "shuffled": dict(group_index=[1, 0, 2, 1, 0, 2, 3], prefix_lengths=[3, 5, 0, 2], row_lengths=[2, 3, 4, 0, 1, 3, 0]),
    # G = 1, a single query per row.
    "one row each": dict(group_index=[0, 1, 2], prefix_lengths=[1, 7, 2], row_lengths=[1, 1, 1]),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_cascade_matches_plain_attention_forward_and_backward(name, softcap):
    case, rows, group_index, segments, visible = cascade_case(3, **CASES[name])
    out, grads = run_cascade(case, rows, group_index, segments, softcap)
    expected, expected_grads = plain_cascade(case, visible, softcap)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for what, got, want in zip(("q", "k", "v", "prefix k", "prefix v"), grads, expected_grads):
        assert want.abs().max() > 0 or want.numel() == 0
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=what)


def test_merge_of_two_halves_is_attention_over_their_union():
    q, k, v, _ = tensors(3, 6, 2, 2, 4, 4, seed=5)
    with torch.no_grad():
        halves = [
            flash_reference.varlen_forward(q, k[s], v[s], offsets([3]), offsets([3]), 3, 3, scale=0.5, causal=False)
            for s in (slice(0, 3), slice(3, 6))
        ]
        out, lse = flash.merge(*halves[0], *halves[1])
        whole, whole_lse = flash_reference.varlen_forward(
            q, k, v, offsets([3]), offsets([6]), 3, 6, scale=0.5, causal=False
        )
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=1e-12)
