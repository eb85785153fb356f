"""The TRL plug-in under accelerate's FSDP2, two gloo processes on CPU: patched training equals unpatched.

accelerate takes its FSDP path only for accelerator process groups (``AcceleratorState`` sets ``DistributedType.FSDP``
for MULTI_GPU/NPU/XPU/... and leaves MULTI_CPU alone: with ``use_cpu=True`` the FSDP plugin is dropped and the
trainer silently trains DDP). :func:`_let_accelerate_shard_on_cpu` opens that one gate for the CPU/gloo group, so
everything after it is accelerate's and transformers' own FSDP2 code: ``fsdp2_prepare_model`` (``fully_shard`` per
decoder layer by the TRANSFORMER_BASED_WRAP policy, then the root, ``reshard_after_forward=True``), gradient
accumulation (``set_requires_gradient_sync``), FSDP2 gradient clipping and the optimizer on DTensor parameters.
"""

from __future__ import annotations

import faulthandler
import socket

import pytest
import torch
import torch.multiprocessing as mp
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import DTensor

pytest.importorskip("trl")

from support.distributed import set_rank_environment  # noqa: E402
from support.trl_tiny import make_trainer, record_training, scripted_generate  # noqa: E402

from shared_prefix_logps.integrations.trl import patch_grpo_trainer  # noqa: E402

TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}
FSDP_CONFIGS = {
    2: {
        "fsdp_version": 2,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
        "reshard_after_forward": True,
    },
    # FSDP1 (FullyShardedDataParallel): each decoder layer a unit, the rest in the root; FULL_SHARD
    1: {
        "fsdp_version": 1,
        "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
        "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
        "reshard_after_forward": "FULL_SHARD",
        "use_orig_params": True,
        "sync_module_states": False,  # True needs an accelerator device; both processes load the same weights
    },
}


def _let_accelerate_shard_on_cpu():
    """Make ``AcceleratorState`` treat the CPU/gloo process group like an accelerator group when an FSDP plugin is
    given (the only CPU-specific gate on accelerate's FSDP path; for FSDP1 also the device name). accelerate then
    records ``DistributedType.FSDP`` itself, in ``AcceleratorState`` and ``PartialState``."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        shared = PartialState._shared_state
        if fsdp_plugin is not None and shared.get("distributed_type") == DistributedType.MULTI_CPU:
            shared["distributed_type"] = DistributedType.MULTI_GPU
            if fsdp_plugin.fsdp_version == 1:
                # accelerate passes its device as FSDP1's device_id, and FSDP1 requires it to equal the compute
                # device of CPU parameters, "cpu" (accelerate's CPU processes name "cpu:0")
                shared["device"] = torch.device("cpu")
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)

    AcceleratorState.__init__ = init


def _worker(rank, port, path, results, fsdp_version):
    """One of two gloo processes: unpatched, logps and chunked runs of the same FSDP trainer, one after the other."""
    set_rank_environment(rank, port)
    # A process left waiting for a collective dies with its stack instead of hanging the test (a run takes seconds)
    faulthandler.dump_traceback_later(300, exit=True)
    torch.set_num_threads(1)
    _let_accelerate_shard_on_cpu()
    config = dict(
        kind="ref",  # a separate reference model, which TRL shards too
        beta=0.04,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,  # old-policy log-probs: no-grad calls over whole generation batches
        temperature=0.7,
        top_entropy_quantile=0.6,  # chunked: a no-grad scoring pass per micro-batch; TRL gathers the quantile
        mask_truncated_completions=True,
        ddp_backend="gloo",
        ddp_timeout=120,  # processes out of step fail in minutes instead of hanging for half an hour
        fsdp=True,
        fsdp_config=FSDP_CONFIGS[fsdp_version],
    )
    for mode in (None, "logps", "chunked"):
        with pytest.MonkeyPatch.context() as monkeypatch:
            # Process 0's first generation batch is all truncated, so all masked: its no-grad calls have nothing to
            # forward while process 1's do, and its self-checks wait while process 1's run.
            scripted_generate(monkeypatch, truncated_calls={0} if rank == 0 else set())
            trainer = make_trainer(path, **config)
            assert str(trainer.accelerator.distributed_type) == "DistributedType.FSDP"
            patch = patch_grpo_trainer(trainer, mode=mode) if mode else None
            run = record_training(trainer)
        _assert_sharded(trainer, fsdp_version)
        stats = None if patch is None else patch.stats
        results[f"{mode}{rank}"] = dict(
            calls=run.logps_calls,
            grads=run.first_grads,
            params=run.params,
            losses=run.losses,
            lrs=run.learning_rates,
            steps=(run.global_step, run.optimizer_steps),
            log=[{k: v for k, v in e.items() if k not in TIMING_KEYS} for e in run.log_history],
            checks=None if stats is None else [c.passed for c in stats.self_checks],
            fallbacks=None if stats is None else stats.fallback_calls,
            chunked_steps=None if stats is None else stats.chunked_steps,
            padding=None if patch is None else patch.lockstep.padding_forwards,
        )
    torch.distributed.destroy_process_group()


def _assert_sharded(trainer, fsdp_version):
    """The policy and reference models are the FSDP version's wrappers (with sharded parameters)."""
    if fsdp_version == 2:
        assert isinstance(trainer.model, FSDPModule) and isinstance(trainer.ref_model, FSDPModule)
        assert all(isinstance(p, DTensor) for p in trainer.model.parameters())
    else:
        assert isinstance(trainer.model, FullyShardedDataParallel)
        assert isinstance(trainer.ref_model, FullyShardedDataParallel)
        assert trainer.accelerator.state.fsdp_plugin.use_orig_params
        units = [m for m in trainer.model.modules() if isinstance(m, FullyShardedDataParallel)]
        assert len(units) == 1 + trainer.model.config.num_hidden_layers


def _relative(a, b):
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("fsdp_version", [2, 1], ids=["fsdp2", "fsdp1"])
def test_two_process_fsdp_matches_unpatched(tmp_path, fsdp_version):
    """accelerate FSDP2 or FSDP1 (gloo, CPU), gradient accumulation 2, a sharded reference model, one process's
    first generation batch all masked: both modes train as the unpatched trainer does (log-probs, losses, gradients,
    parameters, steps, logged metrics), with every self-check passed and no fallback. Under FSDP1 the gradients and
    parameters compared are each process's shards (the same layout in every run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(port, tmp_path, results, fsdp_version), nprocs=2, join=True)
        results = dict(results)
    for rank in range(2):
        base = results[f"None{rank}"]
        for mode in ("logps", "chunked"):
            run = results[f"{mode}{rank}"]
            assert run["checks"] and all(run["checks"]) and run["fallbacks"] == 0
            assert run["chunked_steps"] == (6 if mode == "chunked" else 0)
            assert run["steps"] == base["steps"] == (3, 3) and run["lrs"] == base["lrs"]
            # log-probs TRL received (chunked: the policy's go through chunked_backward instead)
            expected = base["calls"] if mode == "logps" else [c for c in base["calls"] if not c[0]]
            assert len(run["calls"]) == len(expected) > 0
            for (grad, ids, logps, entropies), (base_grad, base_ids, base_logps, base_entropies) in zip(
                run["calls"], expected
            ):
                assert grad == base_grad and torch.equal(ids, base_ids)
                assert float((logps - base_logps).abs().max()) <= 1e-5
                if base_entropies is not None:
                    assert float((entropies - base_entropies).abs().max()) <= 1e-5
            assert run["losses"] == pytest.approx(base["losses"], rel=1e-4, abs=1e-6)
            errors = [_relative(run["grads"][n], g) for n, g in base["grads"].items()]
            assert max(errors) <= 1e-4, (mode, max(errors))
            for n, value in base["params"].items():
                torch.testing.assert_close(run["params"][n], value, rtol=1e-4, atol=1e-4)
            for entry, base_entry in zip(run["log"], base["log"], strict=True):
                assert entry == pytest.approx(base_entry, rel=1e-4, abs=1e-6)
    # process 0's empty batches made it wait for process 1's forwards (and the other way round for the self-checks)
    assert results["logps0"]["padding"] > 0 and results["chunked0"]["padding"] > 0


class _FixedAgreement:
    """A one-process stand-in for :class:`~shared_prefix_logps.integrations.common.lockstep.Lockstep`: the other
    processes' largest value is ``others``."""

    def __init__(self, others):
        self.others = others

    def max(self, value):
        return max(value, self.others)


@pytest.mark.parametrize("others", [0, 4])
def test_padded_groups_share_one_shape_and_keep_every_row(others):
    from shared_prefix_logps.integrations.common.rows import padded_groups

    # rows of three prompts, shuffled: [5, 6] x3, [7] (left-padded) x1, [8, 9] x2
    prompt_ids = torch.tensor([[5, 6], [0, 7], [8, 9], [5, 6], [8, 9], [5, 6]])
    prompt_mask = torch.tensor([[1, 1], [0, 1], [1, 1], [1, 1], [1, 1], [1, 1]])
    completion_ids = torch.arange(6 * 3).reshape(6, 3) + 10
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    prompts, prompts_mask, completions, completions_mask, slot_rows, generations = padded_groups(
        _FixedAgreement(others), prompt_ids, prompt_mask, completion_ids, completion_mask
    )
    assert generations == max(3, others)
    assert prompts.shape == (4, 2) and completions.shape == (4 * generations, 3)
    real = slot_rows >= 0
    assert sorted(slot_rows[real].tolist()) == list(range(6))
    assert torch.equal(completions[real], completion_ids[slot_rows[real]])
    assert torch.equal(completions_mask[real], completion_mask[slot_rows[real]])
    for group in range(3):  # each group's rows, in their order, then padding
        rows = slot_rows[group * generations : (group + 1) * generations]
        rows = rows[rows >= 0]
        assert rows.tolist() == sorted(rows.tolist())
        assert all(torch.equal(prompts[group], prompt_ids[row]) for row in rows.tolist())
    assert not completions_mask[~real][: 3 * generations - 6].any()  # padding rows of real groups are masked
    # the placeholder: a two-token prompt whose rows each have one valid token
    assert prompts_mask[3].tolist() == [1, 1]
    assert completions_mask[3 * generations :].tolist() == [[1, 0, 0]] * generations


def test_chunked_mode_refuses_flat_fsdp1_deepspeed_and_megatron():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from shared_prefix_logps.integrations.trl.checks import check_chunked_supported

    def trainer(kind, fsdp_version=None, use_orig_params=None):
        plugin = None
        if fsdp_version is not None:
            plugin = SimpleNamespace(fsdp_version=fsdp_version, use_orig_params=use_orig_params)
        accelerator = SimpleNamespace(distributed_type=kind, state=SimpleNamespace(fsdp_plugin=plugin))
        return SimpleNamespace(accelerator=accelerator, args=SimpleNamespace())

    with pytest.raises(NotImplementedError, match="use_orig_params"):
        check_chunked_supported(trainer(DistributedType.FSDP, fsdp_version=1, use_orig_params=False))
    for kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        with pytest.raises(NotImplementedError, match="does not support"):
            check_chunked_supported(trainer(kind))
    # FSDP2, and FSDP1 with the original parameters, pass the engine check (and fail on the missing attributes)
    for version, orig in ((2, None), (1, True)):
        with pytest.raises(NotImplementedError, match="lacks"):
            check_chunked_supported(trainer(DistributedType.FSDP, fsdp_version=version, use_orig_params=orig))
