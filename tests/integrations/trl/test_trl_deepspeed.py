"""The TRL plug-in under accelerate's DeepSpeed ZeRO-3, two gloo processes on DeepSpeed's CPU accelerator: patched
training (``mode="logps"``) equals unpatched.

ZeRO-3 gathers each submodule's partitioned parameters on that submodule's forward (and backward) hook, through
collectives the processes pair up by order, so every process must call the same submodules in the same order. The
run below makes the processes' rows differ (process 0's first generation batch is all masked), so the plug-in's
lockstep pads, and TRL's own fused-head forwards (the self-check's reference, which skip the lm_head module) are
padded with forwards of their own kind.

accelerate picks a process-group backend only for accelerators: without one (and without ``use_cpu``, which drops
DeepSpeed) it records a single process. :func:`_let_accelerate_run_deepspeed_on_cpu` gives DeepSpeed's CPU processes
the gloo backend; everything after it is accelerate's, transformers' and TRL's own DeepSpeed code
(``deepspeed.zero.Init`` at load, ``deepspeed.initialize`` for the policy and the reference model,
``engine.backward``/``engine.step``).
"""

from __future__ import annotations

import faulthandler
import os

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("trl")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")

from support.distributed import free_port, keep_deepspeed_from_compiling, set_rank_environment  # noqa: E402
from support.trl_tiny import make_trainer, record_training, scripted_generate  # noqa: E402

TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
ZERO3 = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": False},
    "bf16": {"enabled": False},
    "steps_per_print": 10**9,
}


def _let_accelerate_run_deepspeed_on_cpu():
    """Make ``PartialState`` give a DeepSpeed launch on a machine without accelerators the gloo backend of a CPU
    process group (it otherwise records one process, and accelerate's gathers fail)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend

    def prepare(self, cpu=False, sagemaker_dp=False, backend=None):
        backend, kind = original(self, cpu, sagemaker_dp, backend)
        if kind == DistributedType.NO and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
            return "gloo", DistributedType.MULTI_CPU
        return backend, kind

    PartialState._prepare_backend = prepare


def _full_parameters(trainer) -> dict:
    """Every trainable parameter of the policy, gathered from its ZeRO-3 partitions (a collective)."""
    import deepspeed

    params = [(name, p) for name, p in trainer.model.named_parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        return {name: p.detach().clone() for name, p in params}


def _worker(rank, port, path, results):
    """One of two gloo processes: unpatched and ``mode="logps"`` runs of the same ZeRO-3 trainer, one after the
    other."""
    set_rank_environment(rank, port)
    # A process left waiting for a collective dies with its stack instead of hanging the test (a run takes seconds)
    faulthandler.dump_traceback_later(300, exit=True)
    torch.set_num_threads(1)
    _let_accelerate_run_deepspeed_on_cpu()
    keep_deepspeed_from_compiling()  # accelerate starts DeepSpeed's process group
    from shared_prefix_logps.integrations.trl import patch_grpo_trainer

    config = dict(
        kind="ref",  # a separate reference model, which TRL wraps in its own ZeRO-3 engine
        beta=0.04,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,  # old-policy log-probs: no-grad calls over whole generation batches
        temperature=0.7,
        top_entropy_quantile=0.6,
        mask_truncated_completions=True,
        use_cpu=False,  # use_cpu drops DeepSpeed; DS_ACCELERATOR=cpu runs it on the CPU
        ddp_backend="gloo",
        ddp_timeout=120,  # processes out of step fail in minutes instead of hanging for half an hour
        deepspeed=ZERO3,
    )
    for mode in (None, "logps"):
        with pytest.MonkeyPatch.context() as monkeypatch:
            # Process 0's first generation batch is all truncated, so all masked: its no-grad calls have nothing to
            # forward while process 1's do, and its self-checks wait while process 1's run.
            scripted_generate(monkeypatch, truncated_calls={0} if rank == 0 else set())
            trainer = make_trainer(path, **config)
            assert str(trainer.accelerator.distributed_type) == "DistributedType.DEEPSPEED"
            assert trainer.accelerator.state.deepspeed_plugin.zero_stage == 3
            patch = patch_grpo_trainer(trainer, mode=mode) if mode else None
            run = record_training(trainer)
        stats = None if patch is None else patch.stats
        results[f"{mode}{rank}"] = dict(
            calls=run.logps_calls,
            params=_full_parameters(trainer),
            losses=run.losses,
            lrs=run.learning_rates,
            steps=(run.global_step, run.optimizer_steps),
            log=[{k: v for k, v in e.items() if k not in TIMING_KEYS} for e in run.log_history],
            checks=None if stats is None else [c.passed for c in stats.self_checks],
            fallbacks=None if stats is None else stats.fallback_calls,
            padding=None if patch is None else patch.lockstep.padding_forwards,
        )
    torch.distributed.destroy_process_group()


def test_two_process_zero3_logps_matches_unpatched(monkeypatch, tmp_path):
    """accelerate DeepSpeed ZeRO-3 (gloo, CPU, fp32), gradient accumulation 2, a ZeRO-3 reference model, one
    process's first generation batch all masked: ``mode="logps"`` trains as the unpatched trainer does (every
    log-prob and entropy TRL received, losses, parameters after 3 optimizer steps, steps, learning rates, logged
    metrics), with every self-check passed and no fallback."""
    # DeepSpeed picks its accelerator on import: its CPU one, with gloo, also on machines that have a GPU
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(free_port(), tmp_path, results), nprocs=2, join=True)
        results = dict(results)
    for rank in range(2):
        base, run = results[f"None{rank}"], results[f"logps{rank}"]
        assert run["checks"] and all(run["checks"]) and run["fallbacks"] == 0
        assert run["steps"] == base["steps"] and base["steps"][0] == 3 and run["lrs"] == base["lrs"]
        assert len(run["calls"]) == len(base["calls"]) > 0
        for (grad, ids, logps, entropies), (base_grad, base_ids, base_logps, base_entropies) in zip(
            run["calls"], base["calls"]
        ):
            assert grad == base_grad and torch.equal(ids, base_ids)
            assert float((logps - base_logps).abs().max()) <= 1e-5
            if base_entropies is not None:
                assert float((entropies - base_entropies).abs().max()) <= 1e-5
        assert run["losses"] == pytest.approx(base["losses"], rel=1e-4, abs=1e-6)
        assert base["params"] and base["params"].keys() == run["params"].keys()
        for name, value in base["params"].items():
            assert value.numel() > 0, name  # gathered, not an empty ZeRO-3 placeholder
            torch.testing.assert_close(run["params"][name], value, rtol=1e-4, atol=1e-4)
        for entry, base_entry in zip(run["log"], base["log"], strict=True):
            assert entry == pytest.approx(base_entry, rel=1e-4, abs=1e-6)
    # process 0's empty batches made it wait for process 1's forwards (and the other way round for the self-checks)
    assert results["logps0"]["padding"] > 0
