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


def _peak_scoring_bytes(model, num_prompts, generations, budget, backend):
    # Unpadded rows, so every chunk has the same shape and only the number of chunks changes with the batch.
    gen = torch.Generator().manual_seed(9)
    prompts = torch.randint(0, 101, (num_prompts, 24), generator=gen)
    comps = torch.randint(0, 101, (num_prompts * generations, 12), generator=gen)
    tracker = LiveTensorBytes()
    with torch.no_grad(), tracker:
        compute_logps(model, prompts, comps, token_budget=budget, backend=backend)
    return tracker.peak


def test_scoring_memory_is_flat_in_generations_and_prompts():
    # The live-bytes tracker cannot look inside flex_attention, so this runs the CPU default, expand; the flex
    # path uses the same chunk plan (its results are checked in test_chunked_scoring_equals_one_pass).
    backend = "expand"
    # Wide enough that activations, not the O(batch) ids and outputs, are what a budget has to bound.
    model = build_model("qwen2", layers=4, hidden=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        budget = 3 * 36  # a few rows of 12 completion + 24 prefix tokens, two prompts of 24
        g4 = _peak_scoring_bytes(model, 2, 4, budget, backend)
        g32 = _peak_scoring_bytes(model, 2, 32, budget, backend)
        p8 = _peak_scoring_bytes(model, 8, 4, budget, backend)
        p64 = _peak_scoring_bytes(model, 64, 4, budget, backend)
    assert g32 <= 1.2 * g4, (g4, g32)
    assert p64 <= 1.2 * p8, (p8, p64)
    # Without a budget the same calls do grow, so the bound above is the budget's doing.
    assert _peak_scoring_bytes(model, 2, 32, 10**9, backend) > 2 * g4


def test_flex_phase2_without_valid_tokens_forwards_one_placeholder():
    """Every completion masked (scored with gradient, a batch is no longer skipped): the packed layout has no valid
    query, but a forward needs a token. One placeholder query is forwarded, the head computes nothing for it, and the
    rows come back all zero."""
    from shared_prefix_logps.inputs import group_batch
    from shared_prefix_logps.model import prepare_model
    from shared_prefix_logps.phases import capture_prefix, score_rows

    model = build_model("gemma2")
    prepared = prepare_model(model)
    prompts, pmask, comps, _ = make_batch(2, 3, prompt_len=7, completion_len=5)
    batch = group_batch(prompts, comps, pmask, torch.zeros(comps.shape, dtype=torch.bool), model=prepared)
    part = batch.select_rows(torch.arange(comps.shape[0]))
    assert part.completion_ids.shape == (6, 1)  # one (masked) column is kept
    shapes = []
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda m, args: shapes.append(args[0].shape))
    try:
        with torch.no_grad():  # flex has no backward on CPU; the forward is what differs here
            capture = capture_prefix(prepared, part.prompt_ids, part.prompt_mask, packed=True)
            logps, entropy = score_rows(prepared, part, capture, temperature=1.0, return_entropy=True, packed=True)
    finally:
        handle.remove()
    assert shapes[-1] == (1, 1)
    assert logps.shape == entropy.shape == (6, 1) and not logps.any() and not entropy.any()


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
