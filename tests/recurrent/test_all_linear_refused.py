"""A served hybrid family (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) whose config has no full-attention layer (every entry of
``layer_types`` linear attention) is refused when the model is prepared, by every entry point, with
``UnsupportedModelError`` naming the model type and the layer pattern, before any forward of the model. A pattern with
one full-attention layer is prepared as before."""

from __future__ import annotations

import pytest
import torch
from support.hybrid_models import HYBRID_FAMILIES, hybrid_config, hybrid_model_class

from shared_prefix_logps import (
    UnsupportedModelError,
    chunked_backward,
    chunked_backward_tree,
    compute_logps,
    compute_logps_concatenated,
    compute_logps_tree,
)
from shared_prefix_logps.model import prepare_model


def _hybrid(family: str, layer_types: list[str]):
    """A tiny model of ``family`` with ``layer_types`` (one layer each)."""
    config = hybrid_config(family, layer_types=layer_types, vocab_size=101, max_position_embeddings=64)
    torch.manual_seed(0)
    return hybrid_model_class(family)(config).eval()


def _entry_point_calls():
    """Each entry point's call on a small batch (2 prompts, 2 completions each)."""
    prompts = torch.tensor([[1, 2, 3], [4, 5, 6]])
    completions = torch.tensor([[7, 8], [9, 10], [11, 12], [13, 14]])
    rows = torch.cat([prompts.repeat_interleave(2, 0), completions], dim=1)
    mask = torch.ones_like(rows, dtype=torch.bool)
    score = mask.clone()
    score[:, :3] = False

    def loss(out, rows):
        return out.logps.sum()

    return {
        "compute_logps": lambda m: compute_logps(m, prompts, completions),
        "compute_logps_concatenated": lambda m: compute_logps_concatenated(m, rows, mask, 2),
        "compute_logps_tree": lambda m: compute_logps_tree(m, rows, mask, score),
        "chunked_backward": lambda m: chunked_backward(m, prompts, completions, loss, generations_per_chunk=1),
        "chunked_backward_tree": lambda m: chunked_backward_tree(m, rows, mask, score, loss),
    }


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_without_full_attention_is_refused_before_any_forward(family):
    model = _hybrid(family, ["linear_attention", "linear_attention"])
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    for name, call in _entry_point_calls().items():
        with pytest.raises(UnsupportedModelError) as refused:
            call(model)
        message = str(refused.value)
        assert f"model type {model.config.model_type!r}" in message, (name, message)
        assert "['linear_attention', 'linear_attention']" in message, (name, message)
        assert "no full-attention layer" in message, (name, message)
    assert not forwards  # refused while preparing the model, not after a forward


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_with_a_full_attention_layer_is_prepared(family):
    prepared = prepare_model(_hybrid(family, ["linear_attention", "full_attention"]))
    assert len(prepared.recurrent.layers) == 1
