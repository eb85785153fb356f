"""The patched OpenRLHF ``Actor`` against the unpatched one on the same tiny model and rows: the three log-prob passes,
the GRPO training step with OpenRLHF's own ``PolicyLoss`` (loss, every gradient, parameters after an optimizer step),
LoRA, and the tokens each forward saves."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (make test-openrlhf)")
import torch
from support.openrlhf_setup import grpo_loss, make_actor, openrlhf_rows

from shared_prefix_logps.integrations.openrlhf import get_patch, patch_actor, unpatch_actor


def _pair(self_check=True, **kwargs):
    """Two identical actors, the first patched."""
    reference = make_actor(**kwargs)
    patched = copy.deepcopy(reference)
    patch_actor(patched, self_check=self_check)
    return patched, reference


@pytest.mark.parametrize("layout", ["right_padded", "left_padded", "multi_turn"])
def test_no_grad_log_probs_match_openrlhf(layout):
    """Old-policy and reference passes: action log-probs within 1e-5 of OpenRLHF's forward at temperature 0.7, zero
    where action_mask is 0, float32, same shape; entropy too."""
    patched, reference = _pair(temperature=0.7)
    sequences, attention, actions = openrlhf_rows(
        3, 4, left_pad=layout == "left_padded", multi_turn=layout == "multi_turn"
    )
    with torch.no_grad():
        ours = patched(sequences, actions, attention)
        theirs = reference(sequences, actions, attention)
        ours_e = patched(sequences, actions, attention, return_output=True, return_entropy=True)[1].entropy
        theirs_e = reference(sequences, actions, attention, return_output=True, return_entropy=True)[1].entropy
    assert ours.dtype == theirs.dtype == torch.float32 and ours.shape == theirs.shape == actions.shape
    assert (ours[actions == 0] == 0).all()
    assert bool((ours[actions == 1] < 0).all())
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    width = actions.shape[1]
    torch.testing.assert_close(ours_e[:, -width:] * actions, theirs_e[:, -width:] * actions, atol=1e-5, rtol=0)
    stats = get_patch(patched).stats
    assert stats.fallback_calls == 0 and stats.shared_calls == 2
    assert [check.passed for check in stats.self_checks] == [True]


def _grpo_step(actor, sequences, attention, actions, old, advantages, optimizer):
    """OpenRLHF's training step on one micro-batch with GRPO settings (:func:`grpo_loss`)."""
    log_probs, total = grpo_loss(actor, sequences, attention, actions, old, advantages)
    optimizer.zero_grad()
    total.backward()
    grads = {name: p.grad.clone() for name, p in actor.named_parameters() if p.grad is not None}
    optimizer.step()
    return log_probs.detach(), total.detach(), grads


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_training_step_matches_openrlhf(lora):
    """Policy pass with gradient: log-probs 1e-5, OpenRLHF's PolicyLoss 1e-5, every gradient 1e-4 relative to its
    norm, parameters after an Adam step 1e-5."""
    patched, reference = _pair(temperature=0.9, lora=lora)
    sequences, attention, actions = openrlhf_rows(2, 4, multi_turn=True, seed=1)
    with torch.no_grad():
        old = reference(sequences, actions, attention) + 0.05 * torch.randn(actions.shape) * actions
    advantages = torch.randn(actions.shape[0], 1).expand_as(actions) * actions
    results = []
    for actor in (patched, reference):
        optimizer = torch.optim.Adam([p for p in actor.parameters() if p.requires_grad], lr=1e-3)
        results.append(_grpo_step(actor, sequences, attention, actions, old, advantages, optimizer))
    (ours_lp, ours_loss, ours_g), (theirs_lp, theirs_loss, theirs_g) = results
    torch.testing.assert_close(ours_lp, theirs_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_loss, theirs_loss, atol=1e-5, rtol=0)
    assert ours_g.keys() == theirs_g.keys() and len(ours_g) > 0
    if lora:
        assert all("lora_" in name for name in ours_g)
    for name, grad in theirs_g.items():
        assert grad.abs().max() > 0, name
        error = (ours_g[name] - grad).norm() / grad.norm()
        assert error < 1e-4, f"{name}: relative gradient error {error:.2e}"
    for (name, ours_p), theirs_p in zip(patched.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours_p, theirs_p, atol=1e-5, rtol=0, msg=name)
    stats = get_patch(patched).stats
    assert [check.what for check in stats.self_checks] == ["action log-probs (grad)"]
    assert stats.grad_calls == [(8, 2)]


def test_grouped_batch_embeds_fewer_tokens():
    """Rows of 4 prompts x 4 samples: every prompt forwarded once, counted by the token embedding itself (padding
    included; no self-check, whose reference forward would be counted too)."""
    patched, reference = _pair(self_check=False)
    sequences, attention, actions = openrlhf_rows(4, 4, seed=2)
    counts = []
    for actor in (patched, reference):
        counts.append(0)
        embedding = actor.model.get_input_embeddings()

        def count(module, args, output):
            counts[-1] += args[0].numel()

        handle = embedding.register_forward_hook(count)
        with torch.no_grad():
            actor(sequences, actions, attention)
        handle.remove()
    print(f"tokens embedded: shared {counts[0]}, OpenRLHF {counts[1]}")
    stats = get_patch(patched).stats
    assert stats.tokens_forwarded < stats.dense_tokens == int(attention.sum())
    assert counts[0] < counts[1], counts
    # every row's prompt (the tokens before its first action) is forwarded once per distinct prompt, not per row
    first_action = actions.long().argmax(dim=1) + 1
    prompts = [tuple(sequences[i, : first_action[i]].tolist()) for i in range(sequences.shape[0])]
    repeated = sum(map(len, prompts)) - sum(map(len, set(prompts)))
    assert len(set(prompts)) == 4 and repeated > 0
    assert stats.dense_tokens - stats.tokens_forwarded == repeated


def test_unpatch_restores_openrlhf_forward():
    """After unpatch_actor the instance holds no forward of its own (the class's shows through) and results are
    bitwise OpenRLHF's."""
    actor = make_actor()
    sequences, attention, actions = openrlhf_rows(2, 2)
    with torch.no_grad():
        before = actor(sequences, actions, attention)
    patch_actor(actor)
    assert "forward" in actor.__dict__
    with pytest.raises(ValueError, match="patched already"):
        patch_actor(actor)
    unpatch_actor(actor)
    assert "forward" not in actor.__dict__ and get_patch(actor) is None
    with torch.no_grad():
        assert torch.equal(actor(sequences, actions, attention), before)
    with pytest.raises(ValueError, match="not patched"):
        unpatch_actor(actor)


def test_positional_return_output_is_served_and_self_checked():
    """``return_output`` passed by position (as Actor.forward's signature allows): served, and the self-check's own
    forward repeats the call by name with the entropy, so both quantities are compared."""
    patched, reference = _pair()
    sequences, attention, actions = openrlhf_rows(2, 3, seed=4)
    with torch.no_grad():
        ours, output = patched(sequences, actions, attention, True, return_entropy=True)
        theirs, _ = reference(sequences, actions, attention, True, return_entropy=True)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    (check,) = get_patch(patched).stats.self_checks
    assert check.passed and check.max_abs_entropy is not None and check.max_abs_entropy < 1e-5
