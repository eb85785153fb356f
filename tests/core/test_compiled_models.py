"""Compiled models: every entry point exact on a model compiled whole (``torch.compile(model)``), per decoder layer
(``layer.compile()``) and by accelerate's ``compile_regions``, with dynamo's eager, aot_eager and inductor backends.

Traced naively, the node calls' routes freeze a backward that reads gradients stored by another node: log-probs stayed
exact while every parameter gradient came out zero (whole model) or 80-90% wrong (per layer). Here every parameter's
gradient is compared with the dense path on the uncompiled model (1e-4 relative), and log-probs to 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from support.exactness import max_relative_grad_error, weighted_loss
from support.tiny_models import build_model, make_batch, randomize_lora

from shared_prefix_logps import (
    UnsupportedModelError,
    chunked_backward,
    compute_logps,
    compute_logps_concatenated,
)

GENERATIONS = 3


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch, so no test leans on another's compilations (or their recompile budget)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model, form: str, backend: str, **options):
    """``model`` compiled in ``form``: ``whole`` (the OptimizedModule), ``layers`` (each decoder layer compiled in
    place, as ``layer.compile()``) or ``regions`` (accelerate's ``compile_regions``: a copy of the model whose
    repeated layers and other children are OptimizedModules around the original modules)."""
    if form == "whole":
        return torch.compile(model, backend=backend, **options)
    if form == "layers":
        for layer in model.model.layers:
            layer.compile(backend=backend, **options)
        return model
    if form == "regions":
        from accelerate.utils import compile_regions

        return compile_regions(model, backend=backend, **options)
    raise ValueError(form)


def grads_of(model, loss) -> dict:
    """Every parameter's gradient of ``loss`` by ``backward`` (zeros where none arrived); the grads are reset."""
    model.zero_grad(set_to_none=True)
    loss.backward()
    return collect_grads(model)


def collect_grads(model) -> dict:
    grads = {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def _chunk_loss(rows: int, length: int):
    weights = torch.randn(rows, length, generator=torch.Generator().manual_seed(3))

    def loss_fn(out, row_index):
        return (out.logps * weights[row_index]).sum()

    return loss_fn


def check_entry_points(model, runner, *, entry_points=("compute_logps", "chunked_backward", "concatenated")):
    """Run the entry points through ``runner`` (a compiled form of ``model``) and compare with the dense path of
    ``model``; returns {entry point: (max |logps diff|, max relative gradient error)} and asserts both bounds."""
    prompts, pmask, comps, cmask = make_batch(2, GENERATIONS, prompt_len=7, completion_len=5, seed=4)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask)
    dense = compute_logps(model, prompts, comps, backend="dense", return_entropy=True, **kwargs)
    dense_grads = grads_of(model, weighted_loss(dense))
    loss_fn = _chunk_loss(*comps.shape)
    chunk_reference = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    chunk_grads = grads_of(model, loss_fn(chunk_reference, torch.arange(comps.shape[0])))
    results = {}
    for entry in entry_points:
        if entry == "compute_logps":
            out = compute_logps(runner, prompts, comps, return_entropy=True, **kwargs)
            assert (out.entropy - dense.entropy).abs().max().item() <= 1e-5
            grads, expected = grads_of(model, weighted_loss(out)), dense_grads
        elif entry == "chunked_backward":
            model.zero_grad(set_to_none=True)
            out = chunked_backward(runner, prompts, comps, loss_fn, generations_per_chunk=2, **kwargs)
            grads, expected = collect_grads(model), chunk_grads
        else:
            input_ids = torch.cat([prompts.repeat_interleave(GENERATIONS, 0), comps], 1)
            attention_mask = torch.cat([pmask.repeat_interleave(GENERATIONS, 0), cmask], 1)
            out = compute_logps_concatenated(runner, input_ids, attention_mask, comps.shape[1], return_entropy=True)
            grads, expected = grads_of(model, weighted_loss(out)), dense_grads
        logps_error = (out.logps - dense.logps).abs().max().item()
        grad_error = max_relative_grad_error(grads, expected)
        results[entry] = (logps_error, grad_error)
    for entry, (logps_error, grad_error) in results.items():
        assert logps_error <= 1e-5, (entry, results)
        assert grad_error <= 1e-4, (entry, results)
    # the check can fail: every trainable parameter has a gradient to get wrong
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    assert all(dense_grads[name].norm() > 0 for name in trainable)
    return results


# Dynamo traces the same Python whatever the backend; aot_eager adds the traced backward, where the bug lived.
@pytest.mark.parametrize(
    "form, backend",
    [
        ("whole", "eager"),
        ("layers", "eager"),
        pytest.param("whole", "aot_eager", marks=pytest.mark.slow),
        pytest.param("layers", "aot_eager", marks=pytest.mark.slow),
        pytest.param("regions", "aot_eager", marks=pytest.mark.slow),
    ],
)
def test_entry_points_exact_on_compiled_model(form, backend):
    model = build_model("llama")
    check_entry_points(model, compiled(model, form, backend))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["whole", "layers"])
def test_compute_logps_exact_with_inductor(form):
    # inductor compiles C++ on CPU (minutes on a small machine per model form): one entry point per form
    model = build_model("qwen2")
    check_entry_points(model, compiled(model, form, "inductor"), entry_points=("compute_logps",))


@pytest.mark.slow
def test_layers_compiled_after_the_model_was_used():
    """The head check runs once per model; layers compiled after a first call still go through the exact path."""
    model = build_model("mistral")  # sliding window shorter than the rows
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    with torch.no_grad():
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
    check_entry_points(model, compiled(model, "layers", "aot_eager"), entry_points=("compute_logps",))


@pytest.mark.slow
def test_peft_model_compiled_whole():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(build_model("qwen2"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    randomize_lora(model)
    check_entry_points(model, compiled(model, "whole", "aot_eager"), entry_points=("compute_logps",))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_compiled_layers_with_gradient_checkpointing(use_reentrant):
    model = build_model("llama")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    model.train()
    check_entry_points(model, compiled(model, "layers", "aot_eager"), entry_points=("compute_logps",))


def test_plain_forward_of_compiled_model_unchanged_and_one_graph():
    """After the library has run, the compiled model's own forward still gives its logits, in one graph: the node call
    lookups it passes through are guarded on a flag, not traced into graph breaks."""
    from torch._dynamo.utils import counters

    model = build_model("llama")
    runner = compiled(model, "whole", "eager")
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
        compute_logps(runner, prompts, comps, prompt_mask=pmask, completion_mask=cmask)
        counters.clear()
        got = runner(ids).logits
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert torch.allclose(got, expected, atol=1e-6)


@pytest.mark.parametrize("form", ["whole", "layers"])
def test_fullgraph_compilation_is_refused_with_a_clear_error(form):
    model = build_model("llama")
    runner = compiled(model, form, "eager", fullgraph=True)
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    with pytest.raises(UnsupportedModelError, match="fullgraph=True"):
        compute_logps(runner, prompts, comps, prompt_mask=pmask, completion_mask=cmask)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_on_compiled_model():
    model = build_model("qwen3")
    runner = compiled(model, "whole", "aot_eager")
    prompts, pmask, comps, cmask = make_batch(2, GENERATIONS, prompt_len=7, completion_len=5)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    with torch.no_grad():  # flex has no backward on CPU
        flex = compute_logps(runner, prompts, comps, backend="flex", **kwargs)
        dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    assert (flex.logps - dense.logps).abs().max().item() <= 1e-5
    assert (flex.entropy - dense.entropy).abs().max().item() <= 1e-5


@pytest.mark.parametrize("form", ["whole", "layers"])
def test_tree_entry_points_exact_on_compiled_model(form):
    """compute_logps_tree and chunked_backward_tree through a compiled model (aot_eager traces the backward, where
    the routing's gradients were frozen) equal the tree's dense path on the uncompiled model."""
    from support.trees import pad_rows, random_tree_rows

    from shared_prefix_logps import chunked_backward_tree, compute_logps_tree

    model = build_model("llama")
    ids, mask, score = pad_rows(random_tree_rows(2, depth=3, branching=2, max_segment=4), 2)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(7))
    dense = compute_logps_tree(model, ids, mask, score, backend="dense")
    expected = grads_of(model, (dense.logps * weights).sum())
    runner = compiled(model, form, "aot_eager")
    out = compute_logps_tree(runner, ids, mask, score)
    tree_grads = grads_of(model, (out.logps * weights).sum())
    chunked = chunked_backward_tree(runner, ids, mask, score, lambda o, rows: (o.logps * weights[rows]).sum())
    chunked_grads = collect_grads(model)
    for got, grads in ((out.logps, tree_grads), (chunked.logps, chunked_grads)):
        assert (got - dense.logps).abs().max().item() <= 1e-5
        assert max_relative_grad_error(grads, expected) <= 1e-4
    assert all(expected[name].norm() > 0 for name, p in model.named_parameters() if p.requires_grad)
