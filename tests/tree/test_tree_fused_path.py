"""The expand layout's fused-kernel path (CUDA's, run here on CPU): per-node gathered keys/values recomputed in
backward instead of saved; exact, and the graph holds less."""

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads, weighted_loss
from support.tiny_models import build_model
from support.trees import pad_rows, random_tree_rows

from shared_prefix_logps import compute_logps_tree
from shared_prefix_logps.backends import expand
from shared_prefix_logps.bench.memory import LiveTensorBytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def fused_on_cpu(monkeypatch):
    monkeypatch.setattr(expand, "_FUSED_PATH_DEVICES", expand._FUSED_PATH_DEVICES | {"cpu"})


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_fused_path_matches_dense(family, fused_on_cpu):
    model = build_model(family)
    ids, mask, score = pad_rows(random_tree_rows(5, depth=3, branching=3), 5)
    tree = compute_logps_tree(model, ids, mask, score, return_entropy=True)
    dense = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
    assert (tree.logps - dense.logps).abs().max().item() < 1e-5
    grad_err = max_relative_grad_error(
        parameter_grads(model, weighted_loss(tree)), parameter_grads(model, weighted_loss(dense))
    )
    assert grad_err < 1e-4


def _graph_bytes(model, ids, mask, score):
    """Live tensor bytes right after a grad-enabled forward: what its graph holds for backward."""
    tracker = LiveTensorBytes()
    with tracker:
        out = compute_logps_tree(model, ids, mask, score)
        held = tracker.live
    del out
    return held


def test_fused_path_saves_no_gathered_copies(monkeypatch):
    model = build_model("llama", hidden=64)
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, 101, (96,), generator=gen)
    ids = torch.stack([torch.cat([system, torch.randint(0, 101, (4,), generator=gen)]) for _ in range(16)])
    mask = torch.ones_like(ids, dtype=torch.bool)
    score = mask.clone()
    score[:, 0] = False
    compute_logps_tree(model, ids, mask, score)  # the head check, outside the measurement
    plain = _graph_bytes(model, ids, mask, score)
    monkeypatch.setattr(expand, "_FUSED_PATH_DEVICES", expand._FUSED_PATH_DEVICES | {"cpu"})
    fused = _graph_bytes(model, ids, mask, score)
    # 16 leaves x 96 ancestor tokens gathered per layer: the copies dominate what the plain graph holds.
    assert fused < 0.7 * plain, (plain, fused)
