"""MoE router statistics of trees: the model's own aux loss of the rows' dense forward, and its gradient."""

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import build_model
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import compute_logps_tree

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _dense_aux(model, ids, mask):
    """The model's own aux loss of the full rows (every real token routed once per row that holds it)."""
    positions = (mask.long().cumsum(1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions, output_router_logits=True)
    return out.aux_loss


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_aux_loss_and_its_gradient_match_the_model(family):
    model = build_model(family)
    ids, mask, score = pad_rows(random_tree_rows(6, depth=3, branching=3), 6)
    out = compute_logps_tree(model, ids, mask, score, return_router_stats=True)
    dense = _dense_aux(model, ids, mask)
    aux = out.router.aux_loss()
    assert float((aux - dense).detach().abs()) <= 1e-6, (float(aux), float(dense))
    assert out.router.tokens.tolist() == (mask.sum(1) * 2).float().tolist()  # 2 MoE layers per real token
    assert max_relative_grad_error(parameter_grads(model, aux), parameter_grads(model, dense)) <= 1e-4
    out = compute_logps_tree(model, ids, mask, score, return_router_stats=True)
    dense_logps = compute_logps_tree(model, ids, mask, score, backend="dense")
    ours = parameter_grads(model, weighted_loss(out) + 0.5 * out.router.aux_loss())
    reference = parameter_grads(model, weighted_loss(dense_logps) + 0.5 * _dense_aux(model, ids, mask))
    assert max_relative_grad_error(ours, reference) <= 1e-4


@pytest.mark.parametrize("budget", [1, None])
def test_no_grad_walk_gives_the_same_statistics(budget):
    model = build_model("qwen3_moe")
    ids, mask, score = pad_rows(random_tree_rows(6, depth=3, branching=3), 6)
    with torch.no_grad():
        out = compute_logps_tree(model, ids, mask, score, return_router_stats=True, token_budget=budget)
        dense = _dense_aux(model, ids, mask)
        rows = torch.tensor([0, 2, 3])
        subset = _dense_aux(model, ids[rows], mask[rows])
    assert float((out.router.aux_loss() - dense).abs()) <= 1e-6
    assert float((out.router.aux_loss(rows) - subset).abs()) <= 1e-6


def test_router_stats_are_refused_where_the_model_has_no_aux_loss():
    from shared_prefix_logps import UnsupportedModelError

    model = build_model("llama")
    ids, mask, score = pad_rows(random_tree_rows(1, depth=2, branching=2), 1)
    with pytest.raises(UnsupportedModelError, match="computes no router aux loss"):
        compute_logps_tree(model, ids, mask, score, return_router_stats=True)
    with pytest.raises(ValueError, match="needs the shared path"):
        compute_logps_tree(model, ids, mask, score, return_router_stats=True, backend="dense")
