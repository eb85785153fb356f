"""Exactness under activation checkpointing and with LoRA adapters."""

import functools

import pytest
import torch
from support.exactness import compare_with_dense
from support.tiny_models import build_model, make_batch, randomize_lora

from shared_prefix_logps import compute_logps
from shared_prefix_logps.forward.attention import ReentrantCheckpointError


def _batch():
    return make_batch(3, 4, prompt_len=10, completion_len=6, seed=11)


def _compare(model, **kwargs):
    prompts, pmask, comps, cmask = _batch()
    return compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, **kwargs)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_non_reentrant_checkpointing(family):
    model = build_model(family)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()  # checkpointing only runs in training mode
    logps_err, entropy_err, grad_err = _compare(model, temperature=0.7, return_entropy=True)
    assert logps_err <= 1e-5 and entropy_err <= 1e-5 and grad_err <= 1e-4


def _assert_equal_to_plain_dense(checkpointed, plain):
    from support.exactness import parameter_grads, weighted_loss

    prompts, pmask, comps, cmask = _batch()
    ref = compute_logps(plain, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="dense")
    out = compute_logps(checkpointed, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    torch.testing.assert_close(out.logps, ref.logps, rtol=0, atol=1e-5)
    g_ref = parameter_grads(plain, weighted_loss(ref))
    out_loss = weighted_loss(out)
    out_loss.backward()  # reentrant checkpointing refuses autograd.grad, so use .grad like a trainer does
    for name, param in checkpointed.named_parameters():
        assert (param.grad - g_ref[name]).norm() <= 1e-4 * g_ref[name].norm() + 1e-12, name


def test_checkpointing_gradients_equal_plain_model():
    # Checkpointed shared path vs un-checkpointed dense path of the same weights: recomputation changes nothing.
    checkpointed = build_model("qwen2")
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed.train()
    _assert_equal_to_plain_dense(checkpointed, build_model("qwen2"))


def test_reentrant_checkpointing_is_run_non_reentrant_exactly():
    model = build_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    _assert_equal_to_plain_dense(model, build_model("llama"))
    # The model's own checkpointing setting is restored afterwards.
    layer = model.model.layers[0]
    assert layer._gradient_checkpointing_func.keywords["use_reentrant"] is True


def test_unknown_reentrant_checkpointing_is_refused():
    from torch.utils.checkpoint import checkpoint

    model = build_model("llama")
    model.gradient_checkpointing_enable()
    for layer in model.model.layers:
        # A wrapper the library cannot recognise as torch's checkpoint: it must be caught at run time.
        layer._gradient_checkpointing_func = functools.partial(lambda fn, *a: checkpoint(fn, *a, use_reentrant=True))
    model.train()
    prompts, pmask, comps, cmask = _batch()
    inputs = torch.randn(1, requires_grad=True)  # reentrant checkpoint only runs when some input needs grad
    model.model.embed_tokens.register_forward_hook(lambda m, i, o: o + 0 * inputs)
    with pytest.raises(ReentrantCheckpointError, match="use_reentrant"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)


def test_lora_matches_dense_and_reference_from_disabled_adapter():
    peft = pytest.importorskip("peft")
    base = build_model("qwen3")
    reference_model = build_model("qwen3")  # same seed: the weights the adapter starts from
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    # Non-zero adapter weights, so the adapter changes the numbers and its gradients are all non-trivial.
    randomize_lora(model)
    logps_err, entropy_err, grad_err = _compare(model, temperature=0.7, return_entropy=True)
    assert logps_err <= 1e-5 and entropy_err <= 1e-5 and grad_err <= 1e-4

    prompts, pmask, comps, cmask = _batch()
    with torch.no_grad():
        with model.disable_adapter():
            ref_logps = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask).logps
        expected = compute_logps(
            reference_model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="dense"
        ).logps
        adapted = compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask).logps
    torch.testing.assert_close(ref_logps, expected, rtol=0, atol=1e-5)
    assert (adapted - ref_logps).abs().max() > 1e-3  # the adapter really was on outside the context


def test_lora_with_checkpointing():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_model("mistral"), peft.LoraConfig(r=2, target_modules=["k_proj", "o_proj"]))
    randomize_lora(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    logps_err, _, grad_err = _compare(model, temperature=0.7)
    assert logps_err <= 1e-5 and grad_err <= 1e-4
