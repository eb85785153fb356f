"""The flex layout (packed; eager flex_attention without gradients on CPU, its mask through SDPA with them) against
dense: grouped batches and trees."""

import pytest
import torch
from support.exactness import compare_with_dense, max_relative_grad_error
from support.tiny_models import FAMILIES, build_model, make_batch
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import chunked_backward, chunked_backward_tree, compute_logps, compute_logps_tree

# Eager flex_attention on CPU warns that it is unfused; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _taken_grads(model) -> dict:
    """Every parameter's gradient, cloned, the gradients then cleared."""
    found = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return found


def _assert_tree_gradients_match_dense(model) -> None:
    """A random trie of depth 3: flex's gradients through compute_logps_tree and chunked_backward_tree equal dense's."""
    ids, mask, score = pad_rows(random_tree_rows(2, depth=3, branching=3), 2)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))

    def loss_fn(out, rows):
        return (out.logps * weights[rows]).sum()

    every = torch.arange(ids.shape[0])
    loss_fn(compute_logps_tree(model, ids, mask, score, backend="dense"), every).backward()
    reference = _taken_grads(model)
    loss_fn(compute_logps_tree(model, ids, mask, score, backend="flex"), every).backward()
    assert max_relative_grad_error(_taken_grads(model), reference) < 1e-4
    chunked_backward_tree(model, ids, mask, score, loss_fn, rows_per_chunk=2, backend="flex")
    assert max_relative_grad_error(_taken_grads(model), reference) < 1e-4


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


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen2"])
def test_flex_training_on_cpu_runs_its_mask_through_sdpa(family, monkeypatch):
    """Where torch's flex_attention has no backward (CPU), training through ``flex`` runs the same visibility as one
    materialized mask per call through SDPA (explicit scores for Gemma-2's softcap): log-probs, entropies and every
    parameter's gradient equal the dense path's, for grouped batches, trees of depth 3 and the chunked backwards."""
    from shared_prefix_logps.backends import flex as flex_layout

    built = []
    original = flex_layout.dense_node_mask
    monkeypatch.setattr(flex_layout, "dense_node_mask", lambda *a: built.append(1) or original(*a))
    model = build_model(family)
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=9, completion_len=6, seed=3)
    batch = dict(prompt_mask=pmask, completion_mask=cmask)
    ours = compare_with_dense(model, prompts, comps, temperature=0.8, return_entropy=True, backend="flex", **batch)
    assert built and ours[0] < 1e-5 and ours[1] < 1e-5 and ours[2] < 1e-4, ours

    _assert_tree_gradients_match_dense(model)

    rows_weights = torch.randn(comps.shape, generator=torch.Generator().manual_seed(2))
    dense = compute_logps(model, prompts, comps, backend="dense", **batch)
    (dense.logps * rows_weights).sum().backward()
    reference = _taken_grads(model)
    for per_chunk in (1, 3):
        chunked_backward(
            model,
            prompts,
            comps,
            lambda out, rows: (out.logps * rows_weights[rows]).sum(),
            generations_per_chunk=per_chunk,
            backend="flex",
            **batch,
        )
        assert max_relative_grad_error(_taken_grads(model), reference) < 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
@pytest.mark.parametrize("budget", [1, None])
def test_flex_scoring_of_trees_matches_dense(family, budget):
    model = build_model(family)
    ids, mask, score = pad_rows(random_tree_rows(4, depth=4, branching=3), 4)
    with torch.no_grad():
        tree = compute_logps_tree(model, ids, mask, score, return_entropy=True, token_budget=budget, backend="flex")
        dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    assert (tree.logps - dense.logps).abs().max().item() < 1e-5
    assert (tree.entropy - dense.entropy).abs().max().item() < 1e-5


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_flex_gradients_of_trees_match_dense(family, flex_backward_on_cpu):
    model = build_model(family)
    _assert_tree_gradients_match_dense(model)


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
