"""CUDA checks of the flash backend on the real flash-attn kernels (marked ``gpu``; skipped without a CUDA device or
without flash-attn): the installed kernels against the pure-torch reference, call for call, in the conventions the
cascade relies on (varlen offsets, bottom-right causal alignment, windows, softcap, GQA, the log-sum-exp layout, the
backward from a merged output and log-sum-exp); and backend='flash' against dense in bfloat16, with the float64 dense
path as the truth and the bfloat16 dense path's own error as the yardstick.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support import flash_reference
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import compute_logps
from shared_prefix_logps.backends import flash, flash_kernels, sdpa_kernels

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


@pytest.fixture
def kernels():
    installed = flash_kernels.kernels_for(CUDA) if torch.cuda.is_available() else None
    if installed is None:
        pytest.skip("needs flash-attn (pip install 'shared-prefix-logps[flash]') or FA3")
    return installed


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)


@pytest.mark.parametrize(
    "causal, window_left, softcap", [(True, -1, 0.0), (False, -1, 0.0), (True, 3, 0.0), (True, -1, 30.0)]
)
@pytest.mark.parametrize("head_dim", [64, 72, 128])
def test_kernels_match_the_reference(kernels, causal, window_left, softcap, head_dim):
    q_lens, k_lens = [5, 1, 37, 64], [9, 1, 37, 70]
    gen = torch.Generator(device=CUDA).manual_seed(0)
    q = torch.randn(sum(q_lens), 8, head_dim, device=CUDA, generator=gen, dtype=torch.bfloat16)
    k = torch.randn(sum(k_lens), 2, head_dim, device=CUDA, generator=gen, dtype=torch.bfloat16)
    v = torch.randn(sum(k_lens), 2, head_dim, device=CUDA, generator=gen, dtype=torch.bfloat16)
    dout = torch.randn_like(q)
    args = (_offsets(q_lens), _offsets(k_lens), max(q_lens), max(k_lens))
    options = dict(scale=head_dim**-0.5, causal=causal, window_left=window_left, softcap=softcap)
    out, lse = kernels.forward(q, k, v, *args, **options)
    ref_out, ref_lse = flash_reference.varlen_forward(q, k, v, *args, **options)
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=0, atol=2e-2)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-3)
    # The backward from a given (here: the reference's) output and log-sum-exp, as the cascade calls it.
    grads = kernels.backward(dout, q, k, v, ref_out, ref_lse, *args, **options)
    ref_grads = flash_reference.varlen_backward(dout, q, k, v, ref_out, ref_lse, *args, **options)
    for got, want in zip(grads, ref_grads):
        scale = want.float().abs().max()
        assert (got.float() - want.float()).abs().max() <= 2e-2 * scale


def _errors(model, reference, batch, backend):
    prompts, pmask, comps, cmask = batch
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    out = compute_logps(model, prompts, comps, backend=backend, **kwargs)
    truth = compute_logps(reference, prompts, comps, backend="dense", **kwargs)
    grads = parameter_grads(model, weighted_loss(out))
    expected = {n: g.to(torch.bfloat16) for n, g in parameter_grads(reference, weighted_loss(truth)).items()}
    err = (out.logps - truth.logps.float()).abs().max().item()
    return err, max_relative_grad_error(
        {n: g.float() for n, g in grads.items()}, {n: g.float() for n, g in expected.items()}
    )


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_flash_bf16_is_as_close_to_float64_as_dense_bf16(kernels, family):
    # Head dims 16 (llama, qwen2: hidden 64, 4 heads) and 8 (gemma2, padded to a multiple of 8 by the binding; its
    # sliding layers' completions' call goes to flex). The truth: the same bfloat16 weights in float64.
    model = build_model(family, hidden=64, dtype=torch.bfloat16).to(CUDA)
    reference = copy.deepcopy(model).to(torch.float64)
    batch = tuple(t.to(CUDA) for t in make_batch(4, 8, prompt_len=40, completion_len=24, seed=1))
    flash_err, flash_grad = _errors(model, reference, batch, "flash")
    with sdpa_kernels.excluded("CUDNN_ATTENTION"):  # the yardstick shares no kernel with what it judges
        dense_err, dense_grad = _errors(model, reference, batch, "dense")
    assert flash_err <= 2 * dense_err + 1e-2, (flash_err, dense_err)
    assert flash_grad <= 2 * dense_grad + 1e-2, (flash_grad, dense_grad)


def test_flash_refuses_float32_models(kernels):
    model = build_model("llama").to(CUDA)
    prompts, pmask, comps, cmask = (t.to(CUDA) for t in make_batch(2, 2, prompt_len=5, completion_len=3))
    with pytest.raises(ValueError, match="computes in float16/bfloat16"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="flash")


def test_flash_is_available_with_the_kernels(kernels):
    assert flash.available(CUDA)
