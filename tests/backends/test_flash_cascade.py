"""The flash layout's kernels in isolation, in float64: the pure-torch varlen reference against plain attention, and a
node call's parts (its own causal part and one per ancestor level, merged by log-sum-exp, backward from the merged
output and log-sum-exp) against plain attention over [ancestors ; own tokens causally]."""

from __future__ import annotations

import pytest
import torch
from support import flash_reference
from support.flash_reference import REFERENCE
from support.trees import planned_node_calls, random_tree_rows, token_visibility

from shared_prefix_logps.backends import flash
from shared_prefix_logps.backends.flash_kernels import substituted
from shared_prefix_logps.backends.layouts import LayerCall


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


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("rows_per_chunk", [1, 3])
def test_merged_parts_match_plain_attention_forward_and_backward(softcap, rows_per_chunk):
    """Every node call of a depth-4 trie (nodes at every depth, later chunks over several earlier calls): the own
    part and one part per ancestor level, merged by log-sum-exp (backward from the merged output and log-sum-exp),
    against plain attention over [ancestor store ; own tokens] under the trie's visibility, in float64, GQA 4:2."""
    trie, calls = planned_node_calls(
        random_tree_rows(4, depth=4, branching=3, max_segment=4), rows_per_chunk=rows_per_chunk, layout="flash"
    )
    assert max(len(call.levels) for call in calls) >= 3
    gen = torch.Generator().manual_seed(rows_per_chunk)
    heads, kv_heads, dim = 4, 2, 8
    for call in calls:
        n, store = call.num_tokens, call.store_node.numel()
        sizes = [store // max(len(call.sources), 1)] * len(call.sources)
        if sizes:
            sizes[-1] += store - sum(sizes)

        def rand(*shape):
            return torch.randn(*shape, generator=gen, dtype=torch.float64).requires_grad_()

        query, key, value = rand(1, heads, n, dim), rand(1, kv_heads, n, dim), rand(1, kv_heads, n, dim)
        ancestors = [(rand(kv_heads, size, dim), rand(kv_heads, size, dim)) for size in sizes]
        options = dict(scaling=0.3, softcap=softcap, dropout=0.0)
        with substituted(REFERENCE):
            layer = LayerCall(None, call, ancestors, {}, None, options, needs_grad=True)
            ours = flash.node_attention(query, key, value, layer)[0]
        keys = torch.cat([*(k for k, _ in ancestors), key[0]], 1).transpose(0, 1)
        values = torch.cat([*(v for _, v in ancestors), value[0]], 1).transpose(0, 1)
        q = query[0].transpose(0, 1)
        expected = plain_attention(q, keys, values, token_visibility(trie, call, None), 0.3, softcap)
        upstream = torch.randn(expected.shape, generator=gen, dtype=torch.float64)
        inputs = (query, key, value, *(t for pair in ancestors for t in pair))
        grads = torch.autograd.grad((ours * upstream).sum(), inputs)
        expected_grads = torch.autograd.grad((expected * upstream).sum(), inputs)
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-12)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_merge_of_three_parts_is_attention_over_their_union():
    q, k, v, _ = tensors(3, 9, 2, 2, 4, 4, seed=5)
    with torch.no_grad():
        parts = [
            flash_reference.varlen_forward(q, k[s], v[s], offsets([3]), offsets([3]), 3, 3, scale=0.5, causal=False)
            for s in (slice(0, 3), slice(3, 6), slice(6, 9))
        ]
        out, lse = flash.merge([o for o, _ in parts], [lse for _, lse in parts])
        whole, whole_lse = flash_reference.varlen_forward(
            q, k, v, offsets([3]), offsets([9]), 3, 9, scale=0.5, causal=False
        )
    torch.testing.assert_close(out, whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, whole_lse, rtol=0, atol=1e-12)
