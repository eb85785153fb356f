"""The ms-swift plug-in on ms-swift's real GRPO training, through ms-swift's own entry point: ``swift rlhf --rlhf_type
grpo ... --external_plugins <the plug-in file>`` against the same command without it, float32 on CPU.

Five optimizer steps of 2 prompts x 4 generations, a reference model (``beta`` > 0), AdamW, no clipping. Both runs
draw the same completions (the plug-in changes no random draw), so every log-prob pass sees the same rows: the old
policy's, the reference model's and the policy's log-probs, the loss, the first step's gradients and the trained
parameters are compared. ms-swift's chat template gives every prompt its default system prompt (about 70 tokens), so
the calls' distinct prompts share deeper than the prompt: the prefix trie serves them.
"""

from __future__ import annotations

import pytest

pytest.importorskip("swift", reason="ms-swift is not installed (make test-swift)")

import torch  # noqa: E402
from support import swift_setup as ss  # noqa: E402
from support.trees import spy_tree_calls  # noqa: E402

from shared_prefix_logps.integrations.swift import get_patch, plugin_path  # noqa: E402

STEPS = 5


@pytest.fixture(scope="module")
def runs(tiny_root, tmp_path_factory):
    """``(patched, unpatched, tree_calls)``: the two runs' records and the rows of every call the prefix trie served
    in the patched run."""
    from shared_prefix_logps.integrations.swift import uninstall

    model_dir, dataset = ss.build_tiny(tiny_root)
    out = tmp_path_factory.mktemp("swift_grpo")
    with pytest.MonkeyPatch.context() as monkeypatch:
        tree_calls = spy_tree_calls(monkeypatch)
        plugins = [str(ss.REWARD_PLUGIN), plugin_path()]
        argv = ss.grpo_arguments(model_dir, dataset, out / "patched", max_steps=STEPS, external_plugins=plugins)
        patched = ss.run_grpo(monkeypatch, argv, count_embedded=True, with_reference=True)
        uninstall()
        served_by_tree = list(tree_calls)
        argv = ss.grpo_arguments(model_dir, dataset, out / "unpatched", max_steps=STEPS)
        unpatched = ss.run_grpo(monkeypatch, argv, count_embedded=True, with_reference=True)
    return patched, unpatched, served_by_tree


def test_every_pass_is_served_with_ms_swifts_log_probs(runs):
    """Every call of every step (old policy and reference without grad, policy with grad) goes through the plug-in,
    with ms-swift's shape and dtype: on the first step (the same parameters in both runs) within 1e-5 of the unpatched
    run's log-probs at every completion token, and on every step within 1e-5 of ms-swift's own method on the same
    call. Both runs draw the same completions throughout. The stats show the three passes served per step, none
    fallen back, both self-checks passed."""
    patched, unpatched, _ = runs
    kinds = [(call.grad, call.role) for call in unpatched.calls]
    assert kinds == [(False, "policy"), (False, "ref_model"), (True, "policy")] * STEPS
    assert [(call.grad, call.role) for call in patched.calls] == kinds
    for index, (ours, theirs) in enumerate(zip(patched.calls, unpatched.calls)):
        assert torch.equal(ours.input_ids, theirs.input_ids), "the runs drew different completions"
        mask = theirs.completion_mask
        assert ours.logps.shape == theirs.logps.shape and ours.logps.dtype == theirs.logps.dtype == torch.float32
        assert bool(mask.any()) and bool(mask.sum(1).min() < mask.sum(1).max())  # ragged completions
        torch.testing.assert_close(ours.logps[mask], ours.reference[mask], atol=1e-5, rtol=0)
        if index < 3:  # later steps' parameters differ by the optimizer's rounding: compared above, on each run's own
            torch.testing.assert_close(ours.logps[mask], theirs.logps[mask], atol=1e-5, rtol=0)

    stats = get_patch(patched.trainer).stats
    assert stats.passes == {"policy (no grad)": STEPS, "ref_model (no grad)": STEPS, "policy (grad)": STEPS}
    assert stats.shared_calls == 3 * STEPS and stats.fallback_calls == 0 and stats.fallback_reasons == {}
    assert [(check.what, check.passed) for check in stats.self_checks] == [
        ("logps (no grad)", True),
        ("logps (grad)", True),
    ]


def test_loss_gradients_and_trained_parameters_match(runs):
    """The loss of every step within 1e-5, every parameter's gradient of the first step within 1e-4 of its norm, and
    after five AdamW steps every parameter within 1e-5 of its norm, as the unpatched run's."""
    patched, unpatched, _ = runs
    assert len(unpatched.losses) == STEPS and max(abs(x) for x in unpatched.losses) > 1e-3, unpatched.losses
    errors = [abs(ours - theirs) for ours, theirs in zip(patched.losses, unpatched.losses)]
    assert len(patched.losses) == STEPS and max(errors) <= 1e-5, errors

    assert patched.first_grads.keys() == unpatched.first_grads.keys() and len(unpatched.first_grads) > 10
    for name, grad in unpatched.first_grads.items():
        assert grad.norm() > 0, name
        error = float((patched.first_grads[name] - grad).norm() / grad.norm())
        assert error < 1e-4, f"{name}: relative gradient error {error:.2e}"

    initial = ss.build_model("qwen2", *_vocab_eos_pad()).state_dict()
    moved = max(float((value - initial[name]).norm()) for name, value in unpatched.params.items())
    assert moved > 1e-3  # the parameters did train
    for name, value in unpatched.params.items():
        error = float((patched.params[name] - value).norm() / value.norm())
        assert error <= 1e-5, f"{name}: relative parameter error {error:.2e}"


def test_each_prompt_is_embedded_once_per_group(runs):
    """A forward pre-hook on the input embedding counts the token ids each pass embeds: ms-swift embeds every row in
    full; the plug-in embeds each distinct prompt once for its 4 completions, and fewer tokens still than the two-level
    trie could (distinct prompts plus completions), as the distinct prompts share the system prompt, which the
    prefix trie embeds once per call."""
    patched, unpatched, tree_calls = runs
    assert tree_calls == [8] * (3 * STEPS)  # every call of the patched run took the prefix trie
    assert len(patched.embedded) == len(unpatched.embedded) == len(unpatched.calls) == 3 * STEPS
    # from the second step on: the first step's self-checks also run ms-swift's own forward
    for ours, theirs, call in list(zip(patched.embedded, unpatched.embedded, unpatched.calls))[3:]:
        dense = sum(t.numel() for t in theirs)
        assert dense == call.input_ids.numel()  # the unpatched pass: every row, padding included
        floor = _two_level_tokens(call)
        shared = sum(t.numel() for t in ours)
        assert 0 < shared < floor < dense, (shared, floor, dense)


def _two_level_tokens(call) -> int:
    """Real tokens the two-level trie embeds for a call's rows: each distinct prompt (a row's real tokens before its
    first completion token) once, and every real token after it, counted from the rows alone."""
    width = call.completion_mask.shape[1]
    first = call.completion_mask.long().argmax(dim=1) + call.input_ids.shape[1] - width
    prompts, tail = set(), 0
    for row, real, start in zip(call.input_ids.tolist(), call.attention_mask.bool().tolist(), first.tolist()):
        tokens = [token for token, keep in zip(row[:start], real[:start]) if keep]
        prompts.add(tuple(tokens))
        tail += sum(real[start:])
    return sum(len(prompt) for prompt in prompts) + tail


def _vocab_eos_pad():
    tokenizer = ss.build_tokenizer()
    return len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id
