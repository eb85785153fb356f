"""Bad input to the tree entry points gets a clear error naming the argument."""

import pytest
import torch
from support.tiny_models import build_model

from shared_prefix_logps import chunked_backward_tree, compute_logps, compute_logps_tree


@pytest.fixture(scope="module")
def model():
    return build_model("llama")


def _rows():
    ids = torch.tensor([[0, 5, 6, 7], [5, 6, 8, 0]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    score = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    return ids, mask, score


def test_valid_rows_pass(model):
    ids, mask, score = _rows()
    with torch.no_grad():
        out = compute_logps_tree(model, ids, mask, score)
    assert out.logps.shape == (2, 4)


@pytest.mark.parametrize(
    "change,error,pattern",
    [
        (
            lambda i, m, s: (i, torch.tensor([[1, 0, 1, 1], [1, 1, 1, 0]], dtype=torch.bool), s),
            ValueError,
            "attention_mask row 0 is not contiguous",
        ),
        (
            lambda i, m, s: (i, m, s | torch.tensor([[1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)),
            ValueError,
            "score_mask row 0 scores column 0, which is padding",
        ),
        (
            lambda i, m, s: (i, m, s | torch.tensor([[0, 0, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)),
            ValueError,
            "score_mask row 1 scores column 0, the row's first real token",
        ),
        (lambda i, m, s: (i, m[:, :3], s), ValueError, "attention_mask has shape"),
        (lambda i, m, s: (i, m, s[:1]), ValueError, "score_mask has shape"),
        (lambda i, m, s: (i, None, s), ValueError, "attention_mask is required"),
        (lambda i, m, s: (i, m, None), ValueError, "score_mask is required"),
        (lambda i, m, s: (i.float(), m, s), TypeError, "input_ids must hold integer token ids"),
        (lambda i, m, s: (i[0], m, s), ValueError, "input_ids must be 2-D"),
        (lambda i, m, s: (i.tolist(), m, s), TypeError, "input_ids must be a LongTensor"),
        (lambda i, m, s: (i + 1000, m, s), ValueError, "input_ids holds token id"),
        (lambda i, m, s: (i, m.float(), s), TypeError, "attention_mask must be bool or integer"),
        (lambda i, m, s: (i, m, s.long() * 2), ValueError, "score_mask must hold only 0 and 1"),
    ],
)
def test_bad_rows(model, change, error, pattern):
    ids, mask, score = change(*_rows())
    with pytest.raises(error, match=pattern):
        compute_logps_tree(model, ids, mask, score)


@pytest.mark.parametrize(
    "kwargs,pattern",
    [
        (dict(backend="flex"), "no backward on CPU"),
        (dict(backend="nope"), "backend must be one of"),
        (dict(temperature=0.0), "temperature must be positive"),
    ],
)
def test_bad_options(model, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        compute_logps_tree(model, *_rows(), **kwargs)


def _both_entries(model, ids, mask, score):
    """Each tree entry point on the same rows: compute_logps_tree's output, and chunked_backward_tree's."""
    yield lambda: compute_logps_tree(model, ids, mask, score)
    yield lambda: chunked_backward_tree(model, ids, mask, score, lambda out, rows: out.logps.sum())


@pytest.mark.parametrize(
    "change, pattern",
    [
        (lambda i, m, s: (i[:, :0], m[:, :0], s[:, :0]), r"input_ids has no columns, shape \(2, 0\)"),
        (lambda i, m, s: (i.to("meta"), m, s), "input_ids is a meta tensor"),
        (lambda i, m, s: (i, m.to("meta"), s), "attention_mask is a meta tensor"),
        (lambda i, m, s: (i, m, s.to("meta")), "score_mask is a meta tensor"),
    ],
)
def test_no_columns_and_meta_tensors_are_named(model, change, pattern):
    """Zero columns used to fail with argmax's IndexError, meta tensors with 'Cannot copy out of meta tensor'."""
    for call in _both_entries(model, *change(*_rows())):
        with pytest.raises(ValueError, match=pattern):
            call()


def test_a_model_with_meta_weights_is_named():
    with torch.device("meta"):
        meta_model = build_model("llama")
    ids, mask, score = _rows()
    with pytest.raises(ValueError, match="model: LlamaForCausalLM's weights are meta tensors"):
        compute_logps_tree(meta_model, ids, mask, score)
    with pytest.raises(ValueError, match="model: LlamaForCausalLM's weights are meta tensors"):
        compute_logps(meta_model, ids[:, :2], ids[:, 2:])
    with pytest.raises(ValueError, match="prompts is a meta tensor"):
        compute_logps(build_model("llama"), ids[:, :2].to("meta"), ids[:, 2:])


@pytest.mark.parametrize("backend", ["auto", "dense"])
def test_every_row_empty_with_gradients_gives_zeros_with_a_graph(model, backend):
    """Every row all padding, gradients on: zeros that come out of a forward of the model (as the dense forward's
    do), so that loss.backward() works and gives every parameter a zero gradient ('does not require grad' before)."""
    ids, mask, _ = _rows()
    empty = torch.zeros_like(mask)
    out = compute_logps_tree(model, ids, empty, empty, backend=backend)
    assert torch.equal(out.logps, torch.zeros(2, 4)) and out.logps.requires_grad
    out.logps.sum().backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    assert all(g is not None and not g.any() for g in grads)


def test_every_row_empty_in_chunked_backward_tree_back_propagates_zeros(model):
    """chunked_backward_tree hands loss_fn the same zeros with a graph (it handed detached ones, so every
    parameter's .grad stayed None, unlike compute_logps_tree's and chunked_backward's zeros)."""
    ids, mask, _ = _rows()
    empty = torch.zeros_like(mask)
    seen = []

    def loss_fn(out, rows):
        seen.append(out.logps.requires_grad)
        return out.logps.sum()

    out = chunked_backward_tree(model, ids, empty, empty, loss_fn, rows_per_chunk=1)
    grads = [p.grad for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    assert seen == [True, True] and not out.logps.any()
    assert all(g is not None and not g.any() for g in grads)


@pytest.mark.parametrize("entry", ["compute", "chunked"])
def test_reentrant_checkpointing_runs_as_in_the_one_level_path(entry):
    """transformers' reentrant activation checkpointing: the tree pass runs those layers non-reentrant, as the one-level
    phases do, and gets the gradients of the unchecked model."""
    from support.trees import pad_rows, random_tree_rows

    ids, mask, score = pad_rows(random_tree_rows(2, depth=3, branching=2), 2)

    def grads(checkpointing):
        model = build_model("llama")
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        if entry == "compute":
            compute_logps_tree(model, ids, mask, score).logps.sum().backward()
        else:
            chunked_backward_tree(model, ids, mask, score, lambda out, rows: out.logps.sum(), rows_per_chunk=2)
        return [p.grad for p in model.parameters()]

    expected, found = grads(False), grads(True)
    for want, got in zip(expected, found):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
