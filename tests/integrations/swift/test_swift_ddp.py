"""The ms-swift plug-in under two-process DDP on CPU: ``NPROC_PER_NODE=2 swift rlhf ... --use_cpu true`` (ms-swift
launches its ranks through torchrun; accelerate wraps the policy in DistributedDataParallel over gloo), patched against
unpatched, float32, one AdamW step.

Each rank scores its own prompts (the ranks' rows differ); the policy pass calls the DDP-wrapped model, whose reducer
averages the gradients over the ranks as it does for ms-swift's own forward. Both ranks' log-probs, the loss, the
averaged gradients and the trained parameters are compared with the unpatched run's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("swift", reason="ms-swift is not installed (make test-swift)")

import torch  # noqa: E402
from support import swift_setup as ss  # noqa: E402

from shared_prefix_logps.integrations.swift import plugin_path  # noqa: E402


def test_two_process_ddp_matches_unpatched(tiny_root, tmp_path):
    model_dir, dataset = ss.build_tiny(tiny_root)
    settings = dict(per_device_train_batch_size=4, use_cpu="true")  # one prompt's 4 completions per rank
    plugins = [str(ss.REWARD_PLUGIN), plugin_path()]
    argv = ss.grpo_arguments(model_dir, dataset, tmp_path / "patched", external_plugins=plugins, **settings)
    patched = ss.run_swift_command(argv, tmp_path / "patched_record", processes=2)
    argv = ss.grpo_arguments(model_dir, dataset, tmp_path / "unpatched", **settings)
    unpatched = ss.run_swift_command(argv, tmp_path / "unpatched_record", processes=2)

    for rank in (0, 1):
        ours, theirs = patched[rank], unpatched[rank]
        assert theirs["num_processes"] == 2 and theirs["distributed_type"] == "DistributedType.MULTI_CPU"
        assert [c["model"] for c in ours["calls"]] == [c["model"] for c in theirs["calls"]]
        assert ours["calls"][-1]["grad"] and ours["calls"][-1]["model"] == "DistributedDataParallel"
        for mine, other in zip(ours["calls"], theirs["calls"], strict=True):
            assert torch.equal(mine["input_ids"], other["input_ids"]), "the runs drew different completions"
            mask = other["completion_mask"]
            assert bool(mask.any()) and mine["logps"].shape == other["logps"].shape
            torch.testing.assert_close(mine["logps"][mask], other["logps"][mask], atol=1e-5, rtol=0)
        errors = [abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)]
        assert errors and max(errors) <= 1e-5, errors
        assert ours["first_grads"].keys() == theirs["first_grads"].keys() and len(theirs["first_grads"]) > 10
        for name, grad in theirs["first_grads"].items():
            assert grad.norm() > 0, name
            error = float((ours["first_grads"][name] - grad).norm() / grad.norm())
            assert error < 1e-4, f"rank {rank} {name}: relative gradient error {error:.2e}"
        for name, value in theirs["params"].items():
            error = float((ours["params"][name] - value).norm() / value.norm())
            assert error <= 1e-5, f"rank {rank} {name}: relative parameter error {error:.2e}"
        stats = ours["stats"]
        assert stats["passes"] == {"policy (no grad)": 1, "ref_model (no grad)": 1, "policy (grad)": 1}
        assert stats["fallback_calls"] == 0 and all(check["passed"] for check in stats["self_checks"])
        assert unpatched[rank]["stats"] is None

    # the ranks scored different prompts, and DDP gave both the same averaged gradients
    assert not torch.equal(patched[0]["calls"][0]["input_ids"], patched[1]["calls"][0]["input_ids"])
    for name, grad in patched[0]["first_grads"].items():
        torch.testing.assert_close(grad, patched[1]["first_grads"][name], atol=0, rtol=0)
