"""chunked_backward_tree: exact gradients of the sum of chunk losses, memory flat in the number of leaves."""

import pytest
import torch
from support.exactness import max_relative_grad_error
from support.tiny_models import build_model
from support.trees import pad_rows, random_tree_rows, star_batch

from shared_prefix_logps import chunked_backward_tree, compute_logps_tree
from shared_prefix_logps.bench.memory import LiveTensorBytes


def _weights(shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2", "qwen3_moe"])
def test_every_chunk_size_matches_dense(family):
    model = build_model(family)
    rows = random_tree_rows(4, depth=3, branching=3)
    ids, mask, score = pad_rows(rows, 4)
    w_logps, w_entropy = _weights(ids.shape)
    dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    ((dense.logps * w_logps).sum() + (dense.entropy * w_entropy).sum()).backward()
    reference = _grads(model)
    seen_rows = []

    def loss_fn(out, chunk_rows):
        assert out.logps.shape == (len(chunk_rows), ids.shape[1]) and out.logps.requires_grad
        assert torch.equal(out.mask, score[chunk_rows])
        seen_rows.append(chunk_rows)
        return (out.logps * w_logps[chunk_rows]).sum() + (out.entropy * w_entropy[chunk_rows]).sum()

    for rows_per_chunk in (1, 3, len(rows)):
        seen_rows.clear()
        out = chunked_backward_tree(
            model, ids, mask, score, loss_fn, rows_per_chunk=rows_per_chunk, return_entropy=True
        )
        assert sorted(torch.cat(seen_rows).tolist()) == list(range(len(rows)))  # each row in exactly one chunk
        assert not out.logps.requires_grad
        assert (out.logps - dense.logps.detach()).abs().max().item() < 1e-5
        assert (out.entropy - dense.entropy.detach()).abs().max().item() < 1e-5
        grad_err = max_relative_grad_error(_grads(model), reference)
        assert grad_err < 1e-4, (rows_per_chunk, grad_err)


def test_gradients_accumulate_onto_existing_grads():
    model = build_model("llama")
    ids, mask, score = pad_rows(random_tree_rows(2, depth=2, branching=4), 2)
    dense = compute_logps_tree(model, ids, mask, score, backend="dense")
    dense.logps.sum().backward()
    once = _grads(model)
    dense = compute_logps_tree(model, ids, mask, score, backend="dense")
    dense.logps.sum().backward()  # .grad already holds the dense gradient
    chunked_backward_tree(model, ids, mask, score, lambda out, rows: out.logps.sum(), rows_per_chunk=2)
    twice = _grads(model)
    assert max_relative_grad_error(twice, {n: 2 * g for n, g in once.items()}) < 1e-4


def test_nothing_scored_leaves_zero_grads():
    model = build_model("llama")
    ids, mask, _ = pad_rows(random_tree_rows(1, depth=2, branching=2), 1)
    out = chunked_backward_tree(model, ids, mask, torch.zeros_like(mask), lambda out, rows: out.logps.sum())
    assert (out.logps == 0).all()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and (g == 0).all() for g in grads)  # as autograd of the one graph gives


def _peak_bytes(model, ids, mask, score, rows_per_chunk):
    tracker = LiveTensorBytes()
    with tracker:
        chunked_backward_tree(model, ids, mask, score, lambda out, rows: out.logps.sum(), rows_per_chunk=rows_per_chunk)
    model.zero_grad(set_to_none=True)
    return tracker.peak


def test_peak_memory_is_flat_in_leaves():
    """Live tensor bytes (CPU) of one path at a time: 4 leaves vs 64 within 1.15x. Taking every row in one chunk
    (all paths alive) grows with the leaves, which shows the measurement sees the activations."""
    model = build_model("llama", hidden=256)
    small, large = star_batch(4), star_batch(64)
    chunked_backward_tree(model, *small, lambda out, rows: out.logps.sum())  # head check outside the measurement
    model.zero_grad(set_to_none=True)
    peak_small = _peak_bytes(model, *small, rows_per_chunk=1)
    peak_large = _peak_bytes(model, *large, rows_per_chunk=1)
    all_at_once = _peak_bytes(model, *large, rows_per_chunk=64)
    assert peak_large <= 1.15 * peak_small, (peak_small, peak_large)
    assert all_at_once > 3 * peak_large, (peak_large, all_at_once)


@pytest.mark.parametrize(
    "kwargs,error,pattern",
    [
        (dict(rows_per_chunk=0), ValueError, "rows_per_chunk must be at least 1"),
        (dict(rows_per_chunk=1.5), TypeError, "rows_per_chunk must be an int"),
        (dict(backend="dense"), ValueError, "backend='dense' cannot"),
        (dict(loss_fn=3), TypeError, "loss_fn must be callable"),
        (dict(loss_fn=lambda out, rows: out.logps), TypeError, "loss_fn must return a scalar"),
    ],
)
def test_bad_arguments(kwargs, error, pattern):
    model = build_model("llama")
    ids, mask, score = pad_rows(random_tree_rows(1, depth=2, branching=2), 1)
    loss_fn = kwargs.pop("loss_fn", lambda out, rows: out.logps.sum())
    with pytest.raises(error, match=pattern):
        chunked_backward_tree(model, ids, mask, score, loss_fn, **kwargs)


def test_needs_grad_enabled():
    model = build_model("llama")
    ids, mask, score = pad_rows(random_tree_rows(1, depth=2, branching=2), 1)
    with torch.no_grad(), pytest.raises(RuntimeError, match="with gradients enabled"):
        chunked_backward_tree(model, ids, mask, score, lambda out, rows: out.logps.sum())
