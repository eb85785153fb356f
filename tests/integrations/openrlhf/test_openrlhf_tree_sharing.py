"""The OpenRLHF plug-in shares a system prompt common to different prompts, with no configuration change: the patched
``Actor`` scores rows whose distinct prompts start with the same system prompt as a prefix tree (the system prompt
embedded once, not once per prompt), with the unpatched ``Actor``'s log-probs, entropies and gradients. Prompts that
share too little take the two-level trie, as exactly."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (make test-openrlhf)")
import torch
from support.openrlhf_setup import grpo_loss, make_actor, openrlhf_rows
from support.trees import spy_tree_calls

from shared_prefix_logps.integrations.openrlhf import get_patch, patch_actor

SYSTEM = (
    70  # tokens of the shared system prompt: one repeat of it saves more than the searched trie's 64-token threshold
)
SHORT_SYSTEM = 8  # a shared start too short for the searched trie to pay


def _pair(**kwargs):
    """Two identical actors, the first patched (self-checks on)."""
    reference = make_actor(**kwargs)
    patched = copy.deepcopy(reference)
    patch_actor(patched)
    return patched, reference


@pytest.fixture
def tree_calls(monkeypatch):
    """The number of rows of every call the searched trie served."""
    return spy_tree_calls(monkeypatch)


def _counted(actor, run):
    """``run()``'s result and the number of token ids the actor's input embedding received meanwhile."""
    counted = []
    handle = actor.model.get_input_embeddings().register_forward_hook(lambda m, args, out: counted.append(args[0]))
    try:
        result = run()
    finally:
        handle.remove()
    return result, sum(ids.numel() for ids in counted)


def _prompts(sequences, attention, actions) -> list[tuple[int, ...]]:
    """Each row's prompt: its valid tokens before its first action."""
    first_action = actions.long().argmax(dim=1) + 1  # action_mask entry t marks token t + 1
    valid = attention.bool()
    return [tuple(row[:end][keep[:end]].tolist()) for row, keep, end in zip(sequences, valid, first_action.tolist())]


def _two_level_floor(sequences, attention, actions) -> int:
    """The fewest tokens the two-level trie can embed for these rows, counted from the rows alone: each distinct prompt
    but its last token (the prompts' node call) and every valid token after the prompt (the completions'), no
    padding."""
    prompts = _prompts(sequences, attention, actions)
    responses = int(attention.sum()) - sum(map(len, prompts))
    return sum(len(prompt) - 1 for prompt in set(prompts)) + responses


@pytest.mark.parametrize("layout", ["right_padded", "left_padded", "multi_turn"])
def test_no_grad_log_probs_share_the_system_prompt(tree_calls, monkeypatch, layout):
    """4 prompts x 3 samples starting with one system prompt: the searched trie serves the call, embeds fewer tokens
    than the two-level trie can (and than it does, by the 3 repeated system prompts), and the action log-probs and
    entropies are the unpatched Actor's (1e-5)."""
    from shared_prefix_logps.engine import merge
    from shared_prefix_logps.engine import sharing as grouped

    # The trie's own count: the tiny-node rule would merge each few-token prompt node into its responses.
    monkeypatch.setattr(merge, "MERGE_BELOW_SAVED_TOKENS", 0)

    patched, reference = _pair(temperature=0.7)
    rows = openrlhf_rows(
        4, 3, seed=5, system_prompt=SYSTEM, left_pad=layout == "left_padded", multi_turn=layout == "multi_turn"
    )
    sequences, attention, actions = rows

    def score(actor):
        with torch.no_grad():
            return actor(sequences, actions, attention, return_output=True, return_entropy=True)

    score(patched)  # the first call's self-check runs OpenRLHF's own forward too
    tree_calls.clear()
    (ours, ours_out), deeper = _counted(patched, lambda: score(patched))
    assert tree_calls == [12]
    theirs, theirs_out = score(reference)
    width = actions.shape[1]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    entropy = ours_out.entropy[:, -width:] * actions, theirs_out.entropy[:, -width:] * actions
    torch.testing.assert_close(*entropy, atol=1e-5, rtol=0)
    floor = _two_level_floor(*rows)
    assert deeper < floor, (deeper, floor)

    monkeypatch.setattr(grouped, "DEEPER_SHARING_MIN_TOKENS", 10**9)  # the two-level trie only
    two_level_logps, two_level = _counted(patched, lambda: score(patched)[0])
    assert len(tree_calls) == 1  # the searched trie not taken this time
    torch.testing.assert_close(two_level_logps, theirs, atol=1e-5, rtol=0)
    assert two_level >= floor, (two_level, floor)
    assert len(set(_prompts(*rows))) == 4 and deeper <= two_level - 3 * (SYSTEM - 1), (deeper, two_level)
    stats = get_patch(patched).stats
    assert stats.fallback_calls == 0 and [check.passed for check in stats.self_checks] == [True]


def _grpo_step(actor, sequences, attention, actions, old, advantages):
    """OpenRLHF's GRPO loss (:func:`grpo_loss`) and its backward: the log-probs, the loss and every parameter's
    gradient."""
    log_probs, loss = grpo_loss(actor, sequences, attention, actions, old, advantages)
    actor.zero_grad()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in actor.named_parameters() if p.grad is not None}
    return log_probs.detach(), loss.detach(), grads


@pytest.mark.parametrize("system_prompt", [SYSTEM, SHORT_SYSTEM], ids=["tree", "too-short"])
def test_training_step_with_a_shared_system_prompt(tree_calls, system_prompt):
    """Policy pass with gradient on multi-turn rows: with a 70-token shared system prompt the searched trie serves it
    (and embeds fewer tokens than the two-level trie can), with an 8-token one the two-level trie; either way
    log-probs and OpenRLHF's loss within 1e-5 and every gradient within 1e-4 of its norm, as the unpatched Actor's."""
    patched, reference = _pair(temperature=0.9)
    rows = openrlhf_rows(3, 4, seed=6, multi_turn=True, system_prompt=system_prompt)
    sequences, attention, actions = rows
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        old = reference(sequences, actions, attention) + 0.05 * torch.randn(actions.shape, generator=gen) * actions
    advantages = torch.randn((actions.shape[0], 1), generator=gen).expand_as(actions) * actions
    step = (sequences, attention, actions, old, advantages)
    _grpo_step(patched, *step)  # the first grad call's self-check runs OpenRLHF's own forward too
    tree_calls.clear()
    (ours_lp, ours_loss, ours_g), deeper = _counted(patched, lambda: _grpo_step(patched, *step))
    theirs_lp, theirs_loss, theirs_g = _grpo_step(reference, *step)
    assert tree_calls == ([12] if system_prompt == SYSTEM else [])
    torch.testing.assert_close(ours_lp, theirs_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_loss, theirs_loss, atol=1e-5, rtol=0)
    assert ours_g.keys() == theirs_g.keys() and len(ours_g) > 0
    for name, grad in theirs_g.items():
        assert grad.abs().max() > 0, name
        error = (ours_g[name] - grad).norm() / grad.norm()
        assert error < 1e-4, f"{name}: relative gradient error {error:.2e}"
    stats = get_patch(patched).stats
    assert stats.fallback_calls == 0 and [check.what for check in stats.self_checks] == ["action log-probs (grad)"]
    if system_prompt == SYSTEM:
        assert deeper < _two_level_floor(*rows), (deeper, _two_level_floor(*rows))
