"""The patched OpenRLHF ``Actor`` on a tiny Qwen3.5 (a linear-attention hybrid: Gated DeltaNet layers fork their
recurrent state, the attention layer shares keys/values) against the unpatched one: the no-grad log-prob pass and the
GRPO training step with OpenRLHF's own ``PolicyLoss`` (log-probs, loss, every gradient)."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (make test-openrlhf)")
import torch
import transformers
from packaging.version import Version
from support.hybrid_models import build_hybrid
from support.openrlhf_setup import grpo_loss, make_actor, openrlhf_rows

from shared_prefix_logps.integrations.openrlhf import get_patch, patch_actor
from shared_prefix_logps.recurrent.families import MIN_TRANSFORMERS

if Version(transformers.__version__) < MIN_TRANSFORMERS:
    pytest.skip(f"state forking needs transformers >= {MIN_TRANSFORMERS}", allow_module_level=True)


def _pair(temperature: float):
    model = build_hybrid("qwen3_5_text")
    model.train()  # as OpenRLHF trains it (no dropout in these configs)
    reference = make_actor(model=model, temperature=temperature)
    patched = copy.deepcopy(reference)
    patch_actor(patched)
    return patched, reference


def test_no_grad_log_probs_match_openrlhf():
    patched, reference = _pair(temperature=0.7)
    sequences, attention, actions = openrlhf_rows(3, 4, seed=3, system_prompt=6)
    with torch.no_grad():
        ours = patched(sequences, actions, attention)
        theirs = reference(sequences, actions, attention)
    assert ours.shape == theirs.shape == actions.shape
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    stats = get_patch(patched).stats
    assert stats.fallback_calls == 0 and stats.shared_calls == 1
    assert [check.passed for check in stats.self_checks] == [True]


def test_training_step_matches_openrlhf():
    patched, reference = _pair(temperature=0.9)
    sequences, attention, actions = openrlhf_rows(2, 4, multi_turn=True, seed=1)
    with torch.no_grad():
        old = reference(sequences, actions, attention) + 0.05 * torch.randn(actions.shape) * actions
    advantages = torch.randn(actions.shape[0], 1).expand_as(actions) * actions
    results = []
    for actor in (patched, reference):
        actor.zero_grad(set_to_none=True)
        log_probs, total = grpo_loss(actor, sequences, attention, actions, old, advantages)
        total.backward()
        grads = {name: p.grad.clone() for name, p in actor.named_parameters() if p.grad is not None}
        results.append((log_probs.detach(), total.detach(), grads))
    (ours_lp, ours_loss, ours_g), (theirs_lp, theirs_loss, theirs_g) = results
    torch.testing.assert_close(ours_lp, theirs_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_loss, theirs_loss, atol=1e-5, rtol=0)
    assert ours_g.keys() == theirs_g.keys() and any("linear_attn" in name for name in theirs_g)
    for name, grad in theirs_g.items():
        assert (ours_g[name] - grad).norm() <= 1e-4 * max(grad.norm(), 1e-6), name
    assert get_patch(patched).stats.fallback_calls == 0
