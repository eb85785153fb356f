"""No-grad scoring: a depth-first walk in chunks within the token budget, exact, memory flat in prompts, G and rows."""

import warnings

import pytest
import torch
from support.tiny_models import build_model, make_batch
from support.trees import pad_rows, random_tree_rows, star_batch

from shared_prefix_logps import compute_logps, compute_logps_tree
from shared_prefix_logps.bench.memory import LiveTensorBytes

# Eager flex_attention on CPU warns that it is unfused; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


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
    from shared_prefix_logps.engine import run

    gen = torch.Generator().manual_seed(9)
    prompts = torch.randint(0, 101, (num_prompts, 24), generator=gen)
    comps = torch.randint(0, 101, (num_prompts * generations, 12), generator=gen)
    tracker = LiveTensorBytes()
    at_walk = {}

    class Walk(run.Walk):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            at_walk["live"] = tracker.live
            tracker.peak = tracker.live  # from here on: what the forwards add

    with monkeypatch.context() as patch:
        patch.setattr(run, "Walk", Walk)
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


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
@pytest.mark.parametrize("budget", [1, 20, 60, None])
def test_budgeted_scoring_of_trees_matches_dense(family, budget):
    model = build_model(family)
    ids, mask, score = pad_rows(random_tree_rows(4, depth=4, branching=3), 4)
    with torch.no_grad():
        tree = compute_logps_tree(model, ids, mask, score, return_entropy=True, token_budget=budget)
        dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    assert (tree.logps - dense.logps).abs().max().item() < 1e-5
    assert (tree.entropy - dense.entropy).abs().max().item() < 1e-5
    assert (tree.logps[score] != 0).all() and (tree.logps[~score] == 0).all()


def _peak_scoring_bytes(model, leaves, budget):
    tracker = LiveTensorBytes()
    with torch.no_grad(), tracker:
        compute_logps_tree(model, *star_batch(leaves), token_budget=budget)
    return tracker.peak


def test_tree_scoring_memory_is_flat_in_rows():
    # Wide enough that activations and keys/values, not the O(rows) ids, masks and outputs, are what a budget bounds.
    model = build_model("qwen2", layers=4, hidden=768)
    with torch.no_grad():
        compute_logps_tree(model, *star_batch(4), token_budget=64)  # the head check, outside the measurement
    few, many = _peak_scoring_bytes(model, 8, 64), _peak_scoring_bytes(model, 64, 64)
    assert many <= 1.2 * few, (few, many)
    # Without a budget the same call grows, so the bound above is the budget's doing.
    assert _peak_scoring_bytes(model, 64, 10**9) > 2 * few
