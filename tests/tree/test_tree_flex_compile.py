"""The flex layout of trees on the compiled path (what runs on CUDA; compiled here on CPU with ``aot_eager``, under
inductor's CUDA rule that refuses head dimensions below 16, which the tiny models' 8 meet only zero-padded): trees of
any shape reuse one graph per grad mode, and results stay exact against dense."""

from __future__ import annotations

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.graph_counter import CUDA_FLEX_MIN_HEAD_DIM, compile_flex_on_cpu
from support.tiny_models import build_model
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import compute_logps_tree
from shared_prefix_logps.backends import flex

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: flex_attention graphs per model: scoring (no grad) and training; Gemma2's windowed and global layers share them.
GRAPHS_PER_MODEL = 2


@pytest.mark.parametrize("family", ["qwen2", "gemma2"])
def test_trees_of_any_shape_share_one_graph_per_grad_mode_and_stay_exact(family, monkeypatch):
    counter = compile_flex_on_cpu(monkeypatch)
    counter.cuda_rules = True
    monkeypatch.setitem(flex.MIN_HEAD_DIM, "cpu", CUDA_FLEX_MIN_HEAD_DIM)
    model = build_model(family)
    for seed in range(3):  # trees of different shapes: call and store lengths vary
        ids, mask, score = pad_rows(random_tree_rows(seed, depth=3, branching=3, max_segment=30), seed)
        dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
        with torch.no_grad():
            scored = compute_logps_tree(model, ids, mask, score, return_entropy=True, token_budget=1, backend="flex")
        trained = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="flex")
        assert (scored.logps - dense.logps).abs().max().item() <= 1e-5, seed
        assert (trained.logps - dense.logps).abs().max().item() <= 1e-5, seed
        grads = parameter_grads(model, weighted_loss(trained))
        assert max_relative_grad_error(grads, parameter_grads(model, weighted_loss(dense))) <= 1e-4, seed
    assert counter.counts["flex"] == GRAPHS_PER_MODEL, counter.counts
