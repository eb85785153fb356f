"""The binding of flash-attn's private varlen functions (flash_kernels._package_kernels), on CPU: stand-ins with the
signatures of flash-attn 2.7 (a torch.library custom op whose backward writes into caller-allocated dq/dk/dv and
returns only softmax_d) and of FA3 (window as a pair, optional inputs without defaults) that run the reference.
Results through the binding equal the reference's, with head dimensions padded to a multiple of 8 and value heads
of another size."""

from __future__ import annotations

import pytest
import torch
from support import flash_reference

from shared_prefix_logps.backends import flash_kernels


def _checked_window(window_size_right, causal):
    # flash-attn wants right = 0 with causal (or -1 without); anything else would mean a wrong binding.
    assert window_size_right == (0 if causal else -1)


def _check_dims(*tensors):
    assert all(t.shape[-1] % 8 == 0 for t in tensors) and len({t.shape[-1] for t in tensors}) == 1


def _write_visited_rows(targets, grads, cu_q, cu_k):
    """Write dq/dk/dv rows of sequences with queries and keys only, as a kernel that skips empty ones may."""
    for q0, q1, k0, k1 in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        if q1 > q0 and k1 > k0:
            targets[0][q0:q1] = grads[0][q0:q1]
            targets[1][k0:k1] = grads[1][k0:k1]
            targets[2][k0:k1] = grads[2][k0:k1]


@torch.library.custom_op("spl_test::fa2_varlen_fwd", mutates_args=())
def fa2_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert dropout_p == 0.0 and cu_seqlens_q.dtype == torch.int32 and not return_softmax
    _checked_window(window_size_right, causal)
    _check_dims(q, k, v)
    out, lse = flash_reference.varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        scale=softmax_scale, causal=causal, window_left=window_size_left, softcap=softcap,
    )  # fmt: skip
    return out, lse.float(), q.new_empty(0), q.new_empty(2)


@torch.library.custom_op("spl_test::fa2_varlen_bwd", mutates_args=("dq", "dk", "dv"))
def fa2_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: torch.Tensor | None,
    dk: torch.Tensor | None,
    dv: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    deterministic: bool,
    rng_state: torch.Tensor | None = None,
) -> torch.Tensor:
    _checked_window(window_size_right, causal)
    _check_dims(q, k, v, dout, out)
    grads = flash_reference.varlen_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        scale=softmax_scale, causal=causal, window_left=window_size_left, softcap=softcap,
    )  # fmt: skip
    _write_visited_rows((dq, dk, dv), grads, cu_seqlens_q, cu_seqlens_k)
    return softmax_lse.new_zeros(softmax_lse.shape)


def fa3_forward(
    q,
    k,
    v,
    k_new,
    v_new,
    qv,
    out,
    cu_seqlens_q,
    cu_seqlens_k,
    cu_seqlens_k_new,
    seqused_q,
    seqused_k,
    max_seqlen_q,
    max_seqlen_k,
    page_table,
    kv_batch_idx,
    leftpad_k,
    rotary_cos,
    rotary_sin,
    seqlens_rotary,
    q_descale,
    k_descale,
    v_descale,
    softmax_scale,
    causal,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    num_splits=1,
    pack_gqa=None,
    sm_margin=0,
):
    assert k_new is None and page_table is None and out is None
    _checked_window(window_size[1], causal)
    out, lse = flash_reference.varlen_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        scale=softmax_scale, causal=causal, window_left=window_size[0], softcap=softcap,
    )  # fmt: skip
    return out, lse.float(), None, None


def fa3_backward(dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k, max_seqlen_q,
                 max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1), softcap=0.0,
                 deterministic=False, sm_margin=0):  # fmt: skip
    grads = flash_reference.varlen_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        scale=softmax_scale, causal=causal, window_left=window_size[0], softcap=softcap,
    )  # fmt: skip
    for target, grad in zip((dq, dk, dv), grads):
        target.copy_(grad)
    return (softmax_lse,)


@pytest.mark.parametrize("interface", ["flash-attn 2.7", "FA3"])
@pytest.mark.parametrize("causal, window_left, softcap", [(True, -1, 0.0), (False, -1, 0.0), (True, 2, 3.0)])
def test_binding_matches_the_reference(interface, causal, window_left, softcap):
    forward, backward = (fa2_forward, fa2_backward) if interface == "flash-attn 2.7" else (fa3_forward, fa3_backward)
    kernels = flash_kernels._package_kernels(interface, forward, backward)
    gen = torch.Generator().manual_seed(0)
    # The last two sequences: queries without keys, keys without queries (their gradients must be zeros).
    q_lens, k_lens = [3, 4, 2, 0], [5, 4, 0, 3]
    cu_q, cu_k = torch.tensor([0, 3, 7, 9, 9]), torch.tensor([0, 5, 9, 9, 12])
    q = torch.randn(9, 4, 6, generator=gen, dtype=torch.float64)
    k = torch.randn(12, 2, 6, generator=gen, dtype=torch.float64)
    v = torch.randn(12, 2, 5, generator=gen, dtype=torch.float64)
    dout = torch.randn(9, 4, 5, generator=gen, dtype=torch.float64)
    options = dict(scale=0.4, causal=causal, window_left=window_left, softcap=softcap)
    args = (cu_q, cu_k, max(q_lens), max(k_lens))
    out, lse = kernels.forward(q, k, v, *args, **options)
    ref_out, ref_lse = flash_reference.varlen_forward(q, k, v, *args, **options)
    assert out.shape == ref_out.shape
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse.float())
    grads = kernels.backward(dout, q, k, v, ref_out, ref_lse, *args, **options)
    ref_grads = flash_reference.varlen_backward(dout, q, k, v, ref_out, ref_lse, *args, **options)
    for got, want in zip(grads, ref_grads):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_binding_refuses_a_signature_without_names():
    kernels = flash_kernels._package_kernels("opaque", lambda *a, **k: None, lambda *a, **k: None)
    x = torch.zeros(1, 1, 8)
    with pytest.raises(TypeError, match="names no parameters"):
        kernels.forward(x, x, x, torch.tensor([0, 1]), torch.tensor([0, 1]), 1, 1, scale=1.0, causal=True)
