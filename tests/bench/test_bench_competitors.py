"""The benchmark's competitor methods (PrefixGrouper, Liger) compute the dense path's log-probs and gradients."""

import pytest
import torch
from support.tiny_models import build_model
from support.tiny_models import make_batch as make_edge_batch

from shared_prefix_logps import compute_logps
from shared_prefix_logps.bench import competitors
from shared_prefix_logps.bench.methods import METHODS, Batch, method_unavailable
from shared_prefix_logps.bench.runner import Shape, make_batch

PACKAGES = {"prefix_grouper": "prefix_grouper", "liger": "liger_kernel"}


def _dense(model, batch, train):
    model.zero_grad(set_to_none=True)
    logps = METHODS["dense"][0](model, batch, train)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logps, grads


def _check(model, batch, method):
    step = competitors.COMPETITORS[method][0]
    reference, reference_grads = _dense(model, batch, True)
    implementation = model.config._attn_implementation
    with torch.no_grad():
        scored = step(model, batch, False)
    assert scored.dtype == torch.float32 and scored.shape == batch.completions.shape
    assert (scored - reference).abs().max() <= 1e-5
    assert (scored[~batch.completion_mask] == 0).all()
    model.zero_grad(set_to_none=True)
    trained = step(model, batch, True)
    assert (trained - reference).abs().max() <= 1e-5
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == reference_grads.keys()
    for name, expected in reference_grads.items():
        assert (grads[name] - expected).abs().max() <= 1e-4 * expected.abs().max(), name
    model.zero_grad(set_to_none=True)
    assert model.config._attn_implementation == implementation


@pytest.mark.parametrize("method", ["prefix_grouper", "liger"])
def test_matches_dense_on_a_grpo_batch(method):
    pytest.importorskip(PACKAGES[method])
    assert method in METHODS and method_unavailable(method) is None
    model = build_model("qwen2")
    batch = make_batch(Shape(3, 12, 7, 4), model.config.vocab_size, "cpu")
    _check(model, batch, method)
    # The shared-prefix path still works on the same model afterwards (PrefixGrouper switched its attention).
    ours = compute_logps(
        model,
        batch.prompts,
        batch.completions,
        prompt_mask=batch.prompt_mask,
        completion_mask=batch.completion_mask,
        backend="expand",
    )
    assert (ours.logps.detach() - _dense(model, batch, False)[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2"])
def test_prefix_grouper_edge_cases(family):
    """One-token prompt, an empty completion; sliding windows (Mistral, Gemma2) and eager + softcaps (Gemma2)."""
    pytest.importorskip("prefix_grouper")
    model = build_model(family, layers=1)
    batch = Batch(*make_edge_batch(3, 3, 10, 6, seed=1))
    assert not batch.completion_mask[2].any() and batch.prompt_mask[1].sum() == 1
    _check(model, batch, "prefix_grouper")


def test_prefix_grouper_restores_attention_after_an_error():
    pytest.importorskip("prefix_grouper")
    model = build_model("qwen2", layers=1)
    batch = make_batch(Shape(2, 8, 4, 2), model.config.vocab_size, "cpu")
    _dense(model, batch, False)  # switches the model to this library's attention
    before = model.config._attn_implementation
    bad = Batch(batch.prompts + 10_000, batch.prompt_mask, batch.completions, batch.completion_mask)
    with pytest.raises(IndexError):
        competitors.prefix_grouper_step(model, bad, False)
    assert model.config._attn_implementation == before
    reference, _ = _dense(model, batch, False)
    assert (competitors.prefix_grouper_step(model, batch, False) - reference).abs().max() <= 1e-5


def test_liger_edge_cases_and_refuses_softcapped_heads():
    pytest.importorskip("liger_kernel")
    model = build_model("llama", layers=1, tied=True)
    _check(model, Batch(*make_edge_batch(3, 3, 10, 6, seed=1)), "liger")
    gemma = build_model("gemma2", layers=1)
    batch = make_batch(Shape(2, 8, 4, 2), gemma.config.vocab_size, "cpu")
    with pytest.raises(NotImplementedError, match="softcapping"):
        competitors.liger_step(gemma, batch, False)


def test_uninstalled_competitor_is_reported(monkeypatch):
    step, _ = METHODS["liger"]
    monkeypatch.setitem(METHODS, "liger", (step, lambda: False))
    assert method_unavailable("liger") == "not installed (pip install liger-kernel)"
    assert method_unavailable("nope").startswith("unknown method")
