"""The flex backend (packed, forward-only on CPU) and bounded-memory no-grad scoring."""

import warnings

import pytest
import torch
from support.tiny_models import FAMILIES, build_model, make_batch

from shared_prefix_logps import compute_logps
from shared_prefix_logps.bench.memory import LiveTensorBytes

# Eager flex_attention on CPU warns that it is unfused; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("generations", [1, 4])
def test_flex_forward_matches_dense(family, generations):
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(3, generations, prompt_len=13, completion_len=8, seed=generations)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, temperature=0.7, return_entropy=True)
    with torch.no_grad():
        flex = compute_logps(model, prompts, comps, backend="flex", **kwargs)
        dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    assert (flex.logps - dense.logps).abs().max() <= 1e-5
    assert (flex.entropy - dense.entropy).abs().max() <= 1e-5
    assert (flex.logps[~cmask] == 0).all()


def test_flex_backward_on_cpu_is_refused():
    model = build_model("llama")
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=5, completion_len=3)
    with pytest.raises(ValueError, match="no backward on CPU"):
        compute_logps(model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, backend="flex")


@pytest.mark.parametrize("backend", ["expand", "flex"])
@pytest.mark.parametrize("budget", [1, 20, 60])
def test_chunked_scoring_equals_one_pass(backend, budget):
    model = build_model("gemma2")
    prompts, pmask, comps, cmask = make_batch(5, 3, prompt_len=9, completion_len=6, seed=3)
    kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True, backend=backend)
    with torch.no_grad():
        chunked = compute_logps(model, prompts, comps, token_budget=budget, **kwargs)
        dense = compute_logps(model, prompts, comps, **{**kwargs, "backend": "dense"})
    assert (chunked.logps - dense.logps).abs().max() <= 1e-5
    assert (chunked.entropy - dense.entropy).abs().max() <= 1e-5


def _scoring_bytes(model, num_prompts, generations, budget, backend, monkeypatch):
    """(bytes the call's plan holds per scored token, peak bytes the walk's forwards add above what was live when it
    started) of a no-grad call on unpadded rows (every chunk of one shape: only their number changes)."""
    from shared_prefix_logps.engine import scoring

    gen = torch.Generator().manual_seed(9)
    prompts = torch.randint(0, 101, (num_prompts, 24), generator=gen)
    comps = torch.randint(0, 101, (num_prompts * generations, 12), generator=gen)
    tracker = LiveTensorBytes()
    at_walk = {}

    class Walk(scoring.Walk):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            at_walk["live"] = tracker.live
            tracker.peak = tracker.live  # from here on: what the forwards add

    with monkeypatch.context() as patch:
        patch.setattr(scoring, "Walk", Walk)
        with torch.no_grad(), tracker:
            compute_logps(model, prompts, comps, token_budget=budget, backend=backend)
    return at_walk["live"] / comps.numel(), tracker.peak - at_walk["live"]


def test_scoring_memory_is_flat_in_generations_and_prompts(monkeypatch):
    # The live-bytes tracker cannot look inside flex_attention, so this runs the CPU default, expand; the flex
    # path uses the same chunks (its results are checked in test_chunked_scoring_equals_one_pass).
    backend = "expand"
    model = build_model("qwen2", layers=4, hidden=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        budget = 3 * 36  # a few rows of 12 completion + 24 prompt tokens
        (g4_plan, g4), (g16_plan, g16), (p8_plan, p8), (p32_plan, p32) = (
            _scoring_bytes(model, prompts, generations, budget, backend, monkeypatch)
            for prompts, generations in ((2, 4), (2, 16), (8, 4), (32, 4))
        )
        _, unbounded = _scoring_bytes(model, 2, 16, 10**9, backend, monkeypatch)
    # What the forwards add is bounded by the budget, whatever the number of rows...
    assert g16 <= 1.2 * g4, (g4, g16)
    assert p32 <= 1.2 * p8, (p8, p32)
    # ... which is its doing: without a budget the same call's forwards grow.
    assert unbounded > 2 * g4
    # The plan itself (the rows' trie, scored pairs and the walk's bookkeeping, with the caller's ids) holds a few
    # integers per scored token: the O(batch) part no budget bounds.
    assert max(g4_plan, g16_plan, p8_plan, p32_plan) <= 160, (g4_plan, g16_plan, p8_plan, p32_plan)


def test_every_completion_masked_forwards_only_what_a_gradient_needs():
    """Every completion masked: without gradients nothing is forwarded and the rows come back all zero; with them
    only the prompts' node call is made (no completion node has a token), and its zero result hangs off the model's
    graph: every parameter gets the dense path's zero gradient."""
    from shared_prefix_logps.model import prepare_model

    model = build_model("gemma2")
    prepare_model(model)  # its head check's forward, outside the count
    prompts, pmask, comps, _ = make_batch(2, 3, prompt_len=7, completion_len=5)
    kwargs = dict(prompt_mask=pmask, completion_mask=torch.zeros(comps.shape, dtype=torch.bool), return_entropy=True)
    shapes = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda m, args: shapes.append(args[0].shape))
    try:
        with torch.no_grad():
            out = compute_logps(model, prompts, comps, backend="flex", **kwargs)
        assert shapes == [] and not out.logps.any() and not out.entropy.any()
        out = compute_logps(model, prompts, comps, backend="expand", **kwargs)
        assert shapes == [(1, int(pmask.sum()))]  # the prompts' call alone
    finally:
        handle.remove()
    params = [p for p in model.parameters() if p.requires_grad]
    ours = torch.autograd.grad(out.logps.sum() + out.entropy.sum(), params)
    dense = compute_logps(model, prompts, comps, backend="dense", **kwargs)
    theirs = torch.autograd.grad(dense.logps.sum() + dense.entropy.sum(), params, allow_unused=True)
    for mine, reference in zip(ours, theirs):
        assert not mine.any() and (reference is None or not reference.any())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_flex_all_masked_with_grad_gives_zero_gradients_like_dense():
    model = build_model("llama").cuda()
    prompts, pmask, comps, _ = make_batch(2, 3, prompt_len=7, completion_len=5)
    kwargs = dict(prompt_mask=pmask.cuda(), completion_mask=torch.zeros(comps.shape, dtype=torch.bool).cuda())
    params = [p for p in model.parameters() if p.requires_grad]
    grads = {}
    for backend in ("flex", "dense"):
        out = compute_logps(model, prompts.cuda(), comps.cuda(), return_entropy=True, backend=backend, **kwargs)
        grads[backend] = torch.autograd.grad(out.logps.sum() + out.entropy.sum(), params)
    for ours, theirs in zip(grads["flex"], grads["dense"]):
        assert torch.equal(ours, theirs) and not ours.any()
