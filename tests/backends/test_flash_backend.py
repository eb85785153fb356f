"""backend='flash' end to end against the dense reference, on the pure-torch reference of flash-attn's varlen
kernels (substituted for the package): log-probs, entropy and every parameter's gradient, on the families and
paddings the other layouts are tested on, grouped batches and tries of depth 3; and what the layout refuses or hands
to flex, by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.exactness import compare_with_dense, max_relative_grad_error, parameter_grads
from support.flash_reference import REFERENCE
from support.tiny_models import FAMILIES, build_model, make_batch
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import (
    chunked_backward,
    chunked_backward_tree,
    compute_logps,
    compute_logps_concatenated,
    compute_logps_tree,
)
from shared_prefix_logps.backends import flash, flex
from shared_prefix_logps.backends.flash_kernels import substituted

# Windowed layers go to flex, which runs eagerly on CPU and warns that it is unfused: expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

#: Families whose tiny models slide a window shorter than the rows: their windowed layers of calls with ancestors go
#: to flex (module docstring of backends/flash.py), which needs flex's backward on CPU lifted. Value: the completions'
#: call's layers left on flash (Mistral's two layers slide; Gemma2's alternate).
WINDOWED = {"mistral": 0, "gemma2": 1}


class Calls:
    """Counts the layers the flash kernels serve (one merged attention each) and those handed to flex."""

    def __init__(self, monkeypatch):
        self.counts = {}
        for module, name in ((flash, "_MergedAttention"), (flex, "node_attention")):
            self._count(monkeypatch, module, name)

    def _count(self, monkeypatch, module, name):
        original = getattr(module, name)
        if isinstance(original, type):
            apply = original.apply

            def counted(*args):
                self.counts[name] = self.counts.get(name, 0) + 1
                return apply(*args)

            monkeypatch.setattr(module, name, type(name, (), {"apply": staticmethod(counted)}))
        else:

            def counted(*args, **kwargs):
                self.counts[name] = self.counts.get(name, 0) + 1
                return original(*args, **kwargs)

            monkeypatch.setattr(module, name, counted)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("generations", [1, 8])
def test_flash_matches_dense(family, generations, flash_reference_kernels, request, monkeypatch):
    if family in WINDOWED:
        request.getfixturevalue("flex_backward_on_cpu")
    calls = Calls(monkeypatch)
    model = build_model(family)
    # One-token prompt (prompt 1), padded prompts, an empty completion (row 2 when there are enough rows).
    prompts, pmask, comps, cmask = make_batch(3, generations, prompt_len=11, completion_len=7, seed=generations)
    logps_err, entropy_err, grad_err = compare_with_dense(
        model,
        prompts,
        comps,
        prompt_mask=pmask,
        completion_mask=cmask,
        temperature=0.8,
        return_entropy=True,
        backend="flash",
    )
    assert logps_err <= 1e-5 and entropy_err <= 1e-5 and grad_err <= 1e-4, (logps_err, entropy_err, grad_err)
    # The prompts' call (no ancestors) always runs on the flash kernels, windows included; the completions' call too
    # but for windowed layers.
    assert calls.counts.get("_MergedAttention", 0) == 2 + WINDOWED.get(family, 2), calls.counts
    assert calls.counts.get("node_attention", 0) == 2 - WINDOWED.get(family, 2), calls.counts


def test_flash_float64_is_exact_to_rounding(flash_reference_kernels):
    model = build_model("qwen2", dtype=torch.float64)
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=9, completion_len=6, seed=4)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    flash_out = compute_logps(model, prompts, comps, backend="flash", **kwargs)
    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    # The fused head returns float32; the attention and its merge are float64.
    assert (flash_out.logps - dense.logps).abs().max() <= 1e-6
    grads = parameter_grads(model, (flash_out.logps * 1.3).sum() + flash_out.entropy.sum())
    expected = parameter_grads(model, (dense.logps * 1.3).sum() + dense.entropy.sum())
    assert max_relative_grad_error(grads, expected) <= 1e-6


def test_flash_all_prompts_of_one_token(flash_reference_kernels):
    model = build_model("llama")
    prompts, _, comps, cmask = make_batch(2, 3, prompt_len=1, completion_len=5, seed=1)
    errors = compare_with_dense(model, prompts, comps, completion_mask=cmask, backend="flash")
    assert max(errors) <= 1e-4, errors


@pytest.mark.parametrize("generations", [1, 4])
def test_flash_chunked_backward_matches_dense(generations, flash_reference_kernels):
    model = build_model("qwen3")
    prompts, pmask, comps, cmask = make_batch(3, generations, prompt_len=9, completion_len=6, seed=generations)
    weights = torch.randn(comps.shape, generator=torch.Generator().manual_seed(2))
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)

    def loss_fn(out, rows):
        return (out.logps * weights[rows]).sum() + (out.entropy * weights[rows].flip(1)).sum()

    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    expected = parameter_grads(model, loss_fn(dense, torch.arange(comps.shape[0])))
    for chunk in range(1, generations + 1):
        model.zero_grad(set_to_none=True)
        out = chunked_backward(model, prompts, comps, loss_fn, generations_per_chunk=chunk, backend="flash", **kwargs)
        assert (out.logps - dense.logps.detach()).abs().max() <= 1e-5, chunk
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        assert max_relative_grad_error(grads, expected) <= 1e-4, chunk


def test_flash_concatenated_rows_in_any_order(flash_reference_kernels):
    # Shuffled rows: the trie's depth-first order puts each prompt's completions together, runs per ancestor.
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=10, completion_len=6, seed=7)
    group = torch.arange(3).repeat_interleave(4)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    input_ids = torch.cat([prompts[group], comps], 1)[order]
    attention_mask = torch.cat([pmask[group], cmask], 1)[order]
    out = compute_logps_concatenated(model, input_ids, attention_mask, 6, return_entropy=True, backend="flash")
    ref = compute_logps(
        model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True, backend="dense"
    )
    torch.testing.assert_close(out.logps, ref.logps[order], rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref.entropy[order], rtol=0, atol=1e-5)
    w = torch.randn(out.logps.shape, generator=torch.Generator().manual_seed(3))
    grads = parameter_grads(model, (out.logps * w).sum())
    expected = parameter_grads(model, (ref.logps[order] * w).sum())
    assert max_relative_grad_error(grads, expected) <= 1e-4


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2"])
def test_flash_on_tries_of_depth_3(family, flash_reference_kernels, flex_backward_on_cpu, monkeypatch):
    """Rows sharing prefixes at three depths (left- and right-padded, holes in the score mask), the tiny-node rule off
    so that every depth is a call: GQA (all four), sliding windows (Mistral, Gemma2: handed to flex where they hide
    ancestors' keys) and softcaps (Gemma2); scoring within a small budget, gradients, and the chunked walk."""
    model = build_model(family)
    ids, mask, score = pad_rows(random_tree_rows(6, depth=3, branching=2), 6)
    options = dict(return_entropy=True, temperature=0.8, merge_tiny_nodes=False)
    dense = compute_logps_tree(model, ids, mask, score, backend="dense", **options)
    calls = Calls(monkeypatch)
    with torch.no_grad():
        scored = compute_logps_tree(model, ids, mask, score, backend="flash", token_budget=8, **options)
    assert (scored.logps - dense.logps).abs().max() <= 1e-5 and (scored.entropy - dense.entropy).abs().max() <= 1e-5
    assert calls.counts.get("_MergedAttention", 0) > 0
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))

    def loss_fn(out, rows):
        return (out.logps * weights[rows]).sum() + out.entropy.sum()

    expected = parameter_grads(model, loss_fn(dense, torch.arange(ids.shape[0])))
    out = compute_logps_tree(model, ids, mask, score, backend="flash", **options)
    assert max_relative_grad_error(parameter_grads(model, loss_fn(out, torch.arange(ids.shape[0]))), expected) <= 1e-4
    model.zero_grad(set_to_none=True)
    chunked_backward_tree(model, ids, mask, score, loss_fn, rows_per_chunk=2, backend="flash", **options)
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
    assert max_relative_grad_error(grads, expected) <= 1e-4


def test_flash_without_kernels_is_refused():
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    with pytest.raises(ValueError, match="backend='flash' runs flash-attn's CUDA kernels; the model is on cpu"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="flash")


def test_flash_without_package_on_cuda_names_the_package(monkeypatch):
    from shared_prefix_logps.backends import flash_kernels

    monkeypatch.setattr(flash_kernels, "_INSTALLED", [None])
    assert not flash.available(torch.device("cuda"))
    assert "pip install 'shared-prefix-logps[flash]'" in flash.unavailable_reason(torch.device("cuda"))


def test_flash_refuses_a_dtype_its_kernels_do_not_take():
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    half_only = dataclasses.replace(REFERENCE, name="flash-attn 2", dtypes=(torch.bfloat16, torch.float16))
    with substituted(half_only), pytest.raises(ValueError, match="computes in float16/bfloat16, not torch.float32"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="flash")


def test_flash_refuses_dropout(flash_reference_kernels):
    model = build_model("llama")
    model.config.attention_dropout = 0.1
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    with pytest.raises(ValueError, match="flash backend does not apply attention dropout"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="flash")


def test_window_cutting_into_the_prefix_goes_to_flex(flash_reference_kernels, monkeypatch):
    """A window that hides ancestors' keys goes to flex, with gradients too (on CPU through its materialized mask)."""
    model = build_model("mistral")  # window 6 < the rows' positions
    prompts, pmask, comps, cmask = make_batch(3, 2, prompt_len=11, completion_len=7, seed=2)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
    errors = compare_with_dense(model, prompts, comps, backend="flash", **kwargs)
    assert max(errors) <= 1e-4, errors
    calls = Calls(monkeypatch)
    with torch.no_grad():
        out = compute_logps(model, prompts, comps, backend="flash", **kwargs)
        dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    assert (out.logps - dense.logps).abs().max() <= 1e-5
    # The prompts' window is flash-attn's own (both layers); the completions' call's layers are flex's.
    assert calls.counts == {"_MergedAttention": 2, "node_attention": 2}, calls.counts


def test_window_longer_than_every_row_stays_on_flash(flash_reference_kernels, monkeypatch):
    model = build_model("mistral")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=3, completion_len=3, seed=2)  # positions < 6
    calls = Calls(monkeypatch)
    errors = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="flash")
    assert max(errors) <= 1e-4, errors
    assert "node_attention" not in calls.counts


def test_unsupported_head_dim_goes_to_flex(monkeypatch):
    """Head dimensions the kernels do not take go to flex, with gradients too (on CPU through its materialized mask)."""
    model = build_model("llama")  # head_dim 8
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=7, completion_len=4, seed=5)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
    narrow = dataclasses.replace(REFERENCE, max_head_dim=4)
    with substituted(narrow):
        errors = compare_with_dense(model, prompts, comps, backend="flash", **kwargs)
        assert max(errors) <= 1e-4, errors
        calls = Calls(monkeypatch)
        with torch.no_grad():
            out = compute_logps(model, prompts, comps, backend="flash", **kwargs)
    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    assert (out.logps - dense.logps).abs().max() <= 1e-5
    assert calls.counts == {"node_attention": 4}, calls.counts  # both calls' two layers


def test_attention_sinks_go_to_flex(flash_reference_kernels, flex_backward_on_cpu, monkeypatch):
    model = build_model("gpt_oss")
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=7, completion_len=4, seed=6)
    calls = Calls(monkeypatch)
    errors = compare_with_dense(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="flash")
    assert max(errors) <= 1e-4, errors
    assert "_MergedAttention" not in calls.counts and calls.counts.get("node_attention", 0) >= 2


def test_flash_under_activation_checkpointing(flash_reference_kernels):
    # Backward recomputes each layer through the merged parts (their sequences cached in the call's context).
    model = build_model("qwen2")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    prompts, pmask, comps, cmask = make_batch(3, 4, prompt_len=9, completion_len=6, seed=8)
    errors = compare_with_dense(
        model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True, backend="flash"
    )
    assert max(errors) <= 1e-4, errors
