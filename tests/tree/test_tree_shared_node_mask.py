"""A node call whose nodes are all unpadded with as many ancestors (sibling completions under prompts of one length)
shares one mask row between them, instead of writing one per node: the memory one-level sharing's shared mask
takes, where one per node made the tree's no-grad peak exceed one-level sharing's on the agentic benchmark."""

import pytest
import torch
from support.exactness import max_relative_grad_error, parameter_grads
from support.tiny_models import build_model
from support.trees import planned_node_calls, star_batch

from shared_prefix_logps import compute_logps_tree
from shared_prefix_logps.tree import attention
from shared_prefix_logps.tree.attention import node_mask

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _star_rows(leaves):
    ids, _, _ = star_batch(leaves)
    return ids.tolist()


@pytest.mark.parametrize("window", [None, 3, 30])
def test_shared_row_equals_every_node_row(window):
    _, calls = planned_node_calls(_star_rows(8), rows_per_chunk=8)
    uniform = [call for call in calls if call.pack_valid.all() and call.ancestor_valid.all() and call.nodes[0] > 0]
    assert len(uniform) == 2  # the prompts under the system prompt, then the leaves under the prompts
    for call in uniform:
        full = node_mask(call, window, torch.float32)
        shared = node_mask(call, window, torch.float32, shared=True)
        assert shared.shape == (1, *full.shape[1:]) and full.shape[0] == len(call.nodes) > 1
        assert torch.equal(full, shared.expand_as(full))


def test_uniform_calls_build_one_row_and_score_as_dense(monkeypatch):
    model = build_model("qwen2", dtype=torch.float64)
    ids, mask, score = star_batch(8)
    shapes = []

    def spy(call, window, dtype, **kwargs):
        out = node_mask(call, window, dtype, **kwargs)
        shapes.append((len(call.nodes), out.shape[0]))
        return out

    reference = compute_logps_tree(model, ids, mask, score, backend="dense")
    expected = parameter_grads(model, reference.logps.sum())
    monkeypatch.setattr(attention, "node_mask", spy)
    # The tiny-node rule would merge the short prompts into the leaves; the calls counted here are the unmerged trie's.
    out = compute_logps_tree(model, ids, mask, score, merge_tiny_nodes=False)
    grads = parameter_grads(model, out.logps.sum())
    assert shapes == [(4, 1), (8, 1)], shapes  # the root call is causal without a mask
    torch.testing.assert_close(out.logps, reference.logps, rtol=0, atol=1e-6)
    assert max_relative_grad_error(grads, expected) < 1e-5
