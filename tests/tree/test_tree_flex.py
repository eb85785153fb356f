"""The flex layout of trees: one flex_attention call per layer over the ancestors' keys/values in place, under a mask
built from the trie's depth-first numbering; exact against dense rows."""

from __future__ import annotations

import pytest
import torch
from support.exactness import max_relative_grad_error
from support.tiny_models import build_model
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import chunked_backward_tree, compute_logps_tree
from shared_prefix_logps.backends import flex

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_torch_thread"),
]


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3_moe"])
@pytest.mark.parametrize("budget", [1, None])
def test_flex_scoring_matches_dense(family, budget):
    model = build_model(family)
    ids, mask, score = pad_rows(random_tree_rows(4, depth=4, branching=3), 4)
    with torch.no_grad():
        tree = compute_logps_tree(model, ids, mask, score, return_entropy=True, token_budget=budget, backend="flex")
        dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    assert (tree.logps - dense.logps).abs().max().item() < 1e-5
    assert (tree.entropy - dense.entropy).abs().max().item() < 1e-5


def test_flex_with_grad_is_refused_on_cpu():
    model = build_model("llama")
    ids, mask, score = pad_rows(random_tree_rows(1, depth=2, branching=2), 1)
    with pytest.raises(ValueError, match="no backward on CPU"):
        compute_logps_tree(model, ids, mask, score, backend="flex")
    with pytest.raises(ValueError, match="no backward on CPU"):
        chunked_backward_tree(model, ids, mask, score, lambda out, rows: out.logps.sum(), backend="flex")


@pytest.fixture
def flex_backward_on_cpu(monkeypatch):
    """Lift torch's up-front refusal of flex's backward on CPU (its reference backward runs there), so the CUDA
    training path's numbers can be checked here."""
    import torch.nn.attention.flex_attention as flex_module

    monkeypatch.setattr(flex, "_BACKWARD_DEVICES", flex._BACKWARD_DEVICES | {"cpu"})
    validate = flex_module._validate_device

    def validate_without_cpu_backward_refusal(query, key, value):
        if query.device.type != "cpu":
            validate(query, key, value)

    monkeypatch.setattr(flex_module, "_validate_device", validate_without_cpu_backward_refusal)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_flex_gradients_match_dense(family, flex_backward_on_cpu):
    model = build_model(family)
    ids, mask, score = pad_rows(random_tree_rows(2, depth=3, branching=3), 2)
    weights = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1))

    def loss_fn(out, rows):
        return (out.logps * weights[rows]).sum()

    def grads():
        found = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return found

    every = torch.arange(ids.shape[0])
    loss_fn(compute_logps_tree(model, ids, mask, score, backend="dense"), every).backward()
    reference = grads()
    loss_fn(compute_logps_tree(model, ids, mask, score, backend="flex"), every).backward()
    assert max_relative_grad_error(grads(), reference) < 1e-4
    chunked_backward_tree(model, ids, mask, score, loss_fn, rows_per_chunk=2, backend="flex")
    assert max_relative_grad_error(grads(), reference) < 1e-4
