"""The verl plug-in under FSDP2 with two gloo processes (CPU): each process scores and trains on its own rows (other
prompts, group sizes and widths, so the shared path's no-grad forwards differ in number and are joined), and the
patched engines compute what the unpatched ones compute. One process's unsupported micro-batch makes both fall back;
Ulysses sequence parallel (size 2) is left to verl."""

from __future__ import annotations

import faulthandler

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from support import verl_setup as vs  # noqa: E402
from support.distributed import free_port, set_rank_environment  # noqa: E402


def _batches(rank: int):
    """Each process's rows: 12 per process (3 micro-batches of 4), different group layouts per process."""
    if rank == 0:
        return dict(num_prompts=3, generations=4, prompt_len=12, seed=40, shuffle=True)
    return dict(num_prompts=2, generations=6, prompt_len=20, seed=41)


def _worker(rank, port, path, results):
    set_rank_environment(rank, port)
    # A process left waiting for a collective dies with its stack instead of hanging the test (a run takes seconds)
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    vs.use_cpu_platform()
    torch.distributed.init_process_group("gloo")
    from verl.workers.utils.padding import no_padding_2_padding

    from shared_prefix_logps.integrations.verl import get_patch, unpatch_verl_engine

    patched, unpatched = vs.build_engine(path), vs.build_engine(path)
    unpatch_verl_engine(unpatched)
    out = {}
    for name, engine in (("patched", patched), ("unpatched", unpatched)):
        # old-policy log-probs and entropy, no grad
        td = vs.batch_options(engine, vs.rollout_batch(**_batches(rank)))
        with engine.eval_mode():
            result = engine.infer_batch(td)
        logps = no_padding_2_padding(result["model_output"]["log_probs"], td)
        entropy = no_padding_2_padding(result["model_output"]["entropy"], td)
        # a micro-batch one process cannot serve (process 1's second micro-batch has right-padded prompts)
        td = vs.rollout_batch(num_prompts=2, seed=42, prompt_padding="right" if rank == 1 else "left")
        td = vs.batch_options(engine, td)
        with engine.eval_mode():
            mixed = engine.infer_batch(td)
        mixed = no_padding_2_padding(mixed["model_output"]["log_probs"], td)
        # one optimizer step of ppo_loss
        loss_fn = vs.ppo_loss(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
        td = vs.batch_options(engine, vs.rollout_batch(**_batches(rank), temperature=0.9), infer=False)
        vs.assign(td, global_batch_size=24)
        with engine.train_mode():
            trained = engine.train_batch(td, loss_function=loss_fn)
        out[name] = dict(
            logps=logps,
            entropy=entropy,
            mixed=mixed,
            loss=trained["loss"],
            metrics={k: vs.metric_values(v) for k, v in trained["metrics"].items()},
            params=vs.full_parameters(engine),
        )
    # Ulysses sequence parallel over the two processes: verl's own step on both engines
    sp_engines = [vs.build_engine(path, ulysses_sequence_parallel_size=2) for _ in range(2)]
    unpatch_verl_engine(sp_engines[1])
    sp_logps = []
    for engine in sp_engines:
        td = vs.batch_options(engine, vs.rollout_batch(seed=43))  # the same rows on both (one sequence-parallel group)
        with engine.eval_mode():
            result = engine.infer_batch(td)
        sp_logps.append(no_padding_2_padding(result["model_output"]["log_probs"], td))
    out["ulysses"] = dict(
        diff=(sp_logps[0] - sp_logps[1]).abs().max().item(),
        reasons=dict(get_patch(sp_engines[0]).stats.fallback_reasons),
        shared=get_patch(sp_engines[0]).stats.shared_calls,
    )
    patch = get_patch(patched)
    out["stats"] = dict(
        shared=patch.stats.shared_calls,
        reasons=dict(patch.stats.fallback_reasons),
        checks=[check.passed for check in patch.stats.self_checks],
        padding_forwards=patch.lockstep.padding_forwards,
        tokens=(patch.stats.tokens_forwarded, patch.stats.dense_tokens),
    )
    results[rank] = out
    torch.distributed.destroy_process_group()


def test_two_process_fsdp2_matches_unpatched(tmp_path, monkeypatch):
    vs.use_cpu_platform()
    path = vs.save_model(tmp_path / "model", "qwen2")
    # small no-grad chunks: the processes' forward counts differ, so the joins are exercised
    monkeypatch.setenv("SHARED_PREFIX_LOGPS_TOKEN_BUDGET", "40")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_worker, args=(free_port(), path, results), nprocs=2, join=True)
        results = dict(results)
    for rank in range(2):
        ours, theirs = results[rank]["patched"], results[rank]["unpatched"]
        for key in ("logps", "entropy", "mixed"):
            assert (ours[key] - theirs[key]).abs().max().item() < 1e-5, (rank, key)
        vs.assert_same_training_step(ours, theirs, rank)
        stats = results[rank]["stats"]
        assert stats["checks"] == [True, True], stats  # no-grad and grad self-checks, on both processes
        # 3 + 1 + 3 served micro-batches; the second call's second micro-batch fell back on both processes
        assert stats["shared"] == 7, stats
        expected = "not left-padded" if rank == 1 else "another process falls back"
        assert len(stats["reasons"]) == 1 and expected in next(iter(stats["reasons"])), stats
        ulysses = results[rank]["ulysses"]
        assert ulysses["diff"] == 0.0 and ulysses["shared"] == 0, ulysses
        assert ulysses["reasons"] == {"Ulysses sequence parallel (size 2)": 3}, ulysses
    # process 1 has fewer, longer prompts: the processes' no-grad forward counts differ and were joined
    assert results[0]["stats"]["padding_forwards"] + results[1]["stats"]["padding_forwards"] > 0
