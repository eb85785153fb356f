"""The ms-swift plug-in with LoRA and with a linear-attention hybrid (Qwen3.5), through ``swift rlhf``'s own entry
point: patched against unpatched, float32, one AdamW step (the five-step run is test_swift_grpo.py's; later steps sample
from parameters that differ by the optimizer's rounding, and a sampled token can flip).

LoRA (``--tuner_type lora``): ms-swift computes the reference log-probs with the adapter disabled on the policy model
(no separate reference model), so the no-grad passes are the old policy and the adapter-less model. The adapters start
random (``--init_weights false``), so the reference pass differs from the policy's and every adapter weight gets a
gradient. The Qwen3.5 hybrid (Gated DeltaNet, gated attention, Gated DeltaNet) takes the recurrent state-forking path;
ms-swift registers Qwen3.5 as its vision-language model, so the text-only causal LM loads as an unregistered causal LM.
"""

from __future__ import annotations

import pytest

pytest.importorskip("swift", reason="ms-swift is not installed (make test-swift)")

import torch  # noqa: E402
from support import swift_setup as ss  # noqa: E402

from shared_prefix_logps.integrations.swift import get_patch, plugin_path, uninstall  # noqa: E402

STEPS = 1
# --log_entropy: ms-swift asks the policy pass for entropies too (compute_entropy)
SETTINGS = {
    "lora": (
        "qwen2",
        {
            "tuner_type": "lora",
            "lora_rank": 4,
            "lora_alpha": 8,
            "target_modules": ["all-linear"],
            "init_weights": "false",
            "lora_dropout": 0.0,  # ms-swift's default 0.05 makes every forward random: nothing would compare
            "log_entropy": "true",
        },
    ),
    "qwen3_5_hybrid": ("qwen3_5", {"log_entropy": "true"}),
}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_patched_training_matches_unpatched(setting, tiny_root, tmp_path, monkeypatch):
    """Every pass served (none fallen back, both self-checks passed), log-probs within 1e-5 of ms-swift's own on every
    call and of the unpatched run on the first step, the policy pass's entropies within 1e-5 of the unpatched run's,
    the loss within 1e-5, the first gradients within 1e-4 of their norm, the trained parameters within 1e-5 of
    theirs."""
    family, overrides = SETTINGS[setting]
    model_dir, dataset = ss.build_tiny(tiny_root, family)
    settings = dict(overrides, max_steps=STEPS)
    plugins = [str(ss.REWARD_PLUGIN), plugin_path()]
    argv = ss.grpo_arguments(model_dir, dataset, tmp_path / "patched", external_plugins=plugins, **settings)
    patched = ss.run_grpo(monkeypatch, argv, with_reference=True)
    uninstall()
    unpatched = ss.run_grpo(monkeypatch, ss.grpo_arguments(model_dir, dataset, tmp_path / "unpatched", **settings))

    roles = [call.role for call in unpatched.calls]
    expected_roles = ["policy", "policy" if setting == "lora" else "ref_model", "policy"] * STEPS
    assert roles == expected_roles and [call.role for call in patched.calls] == roles
    for index, (ours, theirs) in enumerate(zip(patched.calls, unpatched.calls)):
        assert torch.equal(ours.input_ids, theirs.input_ids), "the runs drew different completions"
        mask = theirs.completion_mask
        assert bool(mask.any()) and ours.logps.dtype == theirs.logps.dtype and ours.logps.shape == theirs.logps.shape
        torch.testing.assert_close(ours.logps[mask], ours.reference[mask], atol=1e-5, rtol=0)
        if index < 3:  # the first step: the same parameters in both runs
            torch.testing.assert_close(ours.logps[mask], theirs.logps[mask], atol=1e-5, rtol=0)
        assert (ours.entropies is None) == (theirs.entropies is None) == (not ours.grad)
        if ours.grad:  # ms-swift asked for entropies (--log_entropy): theirs, ms-swift's shape and dtype
            assert ours.entropies.shape == theirs.entropies.shape and ours.entropies.dtype == theirs.entropies.dtype
            torch.testing.assert_close(ours.entropies[mask], theirs.entropies[mask], atol=1e-5, rtol=0)
    if setting == "lora":  # the reference pass (adapter disabled) is not the policy's
        old, ref = patched.calls[0], patched.calls[1]
        assert not torch.allclose(old.logps[old.completion_mask], ref.logps[ref.completion_mask], atol=1e-3)

    errors = [abs(ours - theirs) for ours, theirs in zip(patched.losses, unpatched.losses)]
    assert len(errors) == STEPS and max(errors) <= 1e-5, errors
    assert patched.first_grads.keys() == unpatched.first_grads.keys() and len(unpatched.first_grads) >= 4
    for name, grad in unpatched.first_grads.items():
        assert grad.norm() > 0, name
        error = float((patched.first_grads[name] - grad).norm() / grad.norm())
        assert error < 1e-4, f"{name}: relative gradient error {error:.2e}"
    if setting == "lora":
        assert all("lora_" in name for name in unpatched.params)  # only the adapter trains
    for name, value in unpatched.params.items():
        error = float((patched.params[name] - value).norm() / value.norm())
        assert error <= 1e-5, f"{name}: relative parameter error {error:.2e}"

    stats = get_patch(patched.trainer).stats
    assert stats.shared_calls == 3 * STEPS and stats.fallback_calls == 0
    assert [check.passed for check in stats.self_checks] == [True, True]
