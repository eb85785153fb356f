"""The TRL plug-in with the MoE router load-balancing loss (``router_aux_loss_coef != 0``), patched vs unpatched.

TRL asks the policy forward for ``aux_loss`` (``compute_aux_loss=True``) and adds ``coef * aux_loss / GA`` to each
micro-batch's loss; the router weights get its gradient. Both plug-in modes must reproduce it: same losses and logged
``aux_loss``, same parameters after the optimizer steps (1e-4), self-checks passing.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from support.trl_tiny import make_trainer, moe_model, record_training  # noqa: E402

from shared_prefix_logps.integrations.trl import patch_grpo_trainer  # noqa: E402

TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}

# A coefficient large enough that the aux term moves the parameters far beyond the comparison's tolerance (checked
# below), so that dropping it, or weighting a prompt once instead of once per row, cannot pass.
COEF = 0.5

CONFIGS = {
    # Groups of 4 split over micro-batches of 4 rows with gradient accumulation 2 (aux / GA), one generation per chunk
    "qwen3_moe": dict(gradient_accumulation_steps=2, per_device_train_batch_size=4, num_generations=4),
    # Entropy masking: one no-grad pass gives both the entropy threshold and the routing counts; 2 generations per chunk
    "mixtral": dict(top_entropy_quantile=0.6, temperature=0.7),
}
GENERATIONS_PER_CHUNK = {"qwen3_moe": 1, "mixtral": 2}


def _trainer(tmp_path, family, **overrides):
    settings = {**CONFIGS[family], "router_aux_loss_coef": COEF, **overrides}
    return make_trainer(tmp_path, model=moe_model(family), **settings)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    cache = {}

    def get(family, coef=COEF):
        if (family, coef) not in cache:
            trainer = _trainer(tmp_path_factory.mktemp(f"base_{family}_{coef}"), family, router_aux_loss_coef=coef)
            assert trainer.aux_loss_enabled == (coef != 0)
            cache[family, coef] = record_training(trainer)
        return cache[family, coef]

    return get


def _max_param_diff(a, b) -> float:
    return max(float((a[n] - value).abs().max()) for n, value in b.items())


@pytest.mark.parametrize("mode", ["logps", "chunked"])
@pytest.mark.parametrize("family", list(CONFIGS))
def test_patched_trainer_with_aux_loss_matches_unpatched(family, mode, baselines, tmp_path):
    base = baselines(family)
    trainer = _trainer(tmp_path, family)
    patch = patch_grpo_trainer(trainer, mode=mode, generations_per_chunk=GENERATIONS_PER_CHUNK[family])
    run = record_training(trainer)

    assert run.global_step == base.global_step == trainer.args.max_steps
    assert run.optimizer_steps == base.optimizer_steps and run.learning_rates == base.learning_rates
    for (grad, ids, logps, _), (base_grad, base_ids, base_logps, _) in zip(
        run.logps_calls, base.logps_calls if mode == "logps" else [c for c in base.logps_calls if not c[0]], strict=True
    ):
        assert grad == base_grad and torch.equal(ids, base_ids)
        assert float((logps - base_logps).abs().max()) <= 1e-5

    # Losses (they include coef * aux / GA), step-1 gradients, parameters after the steps
    assert run.losses == pytest.approx(base.losses, rel=1e-4, abs=1e-6)
    errors = {
        n: float((run.first_grads[n] - g).norm() / g.norm().clamp(min=1e-30)) for n, g in base.first_grads.items()
    }
    assert max(errors.values()) <= 1e-4, max(errors.items(), key=lambda kv: kv[1])
    router = [n for n in base.first_grads if n.endswith((".gate.weight", ".router.weight"))]
    assert router and all(base.first_grads[n].norm() > 0 for n in router)
    assert _max_param_diff(run.params, base.params) <= 1e-4

    # Logged metrics, TRL's aux_loss among them
    assert len(run.log_history) == len(base.log_history)
    assert any("aux_loss" in entry for entry in base.log_history)
    for entry, base_entry in zip(run.log_history, base.log_history):
        assert entry.keys() == base_entry.keys()
        for key, value in base_entry.items():
            if key not in TIMING_KEYS and isinstance(value, float):
                assert entry[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key

    stats = patch.stats
    assert stats.fallback_calls == 0 and not stats.fallback_reasons
    checks = {check.what: check.passed for check in stats.self_checks}
    assert checks and all(checks.values()), checks
    aux_check = (
        "logps (grad) router aux loss (relative)"
        if mode == "logps"
        else "chunked logps (grad) router aux loss (relative)"
    )
    assert aux_check in checks
    assert stats.distinct_prompts < stats.rows
    if mode == "chunked":
        assert stats.max_loss_discrepancy <= 1e-6


def test_the_aux_term_moves_the_parameters_beyond_the_tolerance(baselines):
    """Without the aux term the parameters end elsewhere: the comparison above cannot pass if it is dropped."""
    with_aux, without = baselines("qwen3_moe"), baselines("qwen3_moe", coef=0.0)
    assert _max_param_diff(with_aux.params, without.params) > 1e-3


def test_models_without_an_aux_loss_are_refused(tmp_path):
    model = moe_model("glm4_moe")
    if not hasattr(model.config, "output_router_logits"):
        pytest.skip(
            "this transformers' GLM4-MoE config has no output_router_logits: TRL refuses the coefficient itself"
        )
    trainer = make_trainer(tmp_path, model=model, router_aux_loss_coef=COEF, max_steps=1)
    assert trainer.aux_loss_enabled  # TRL enables it (the config has output_router_logits) ...
    for mode in ("logps", "chunked"):
        with pytest.raises(NotImplementedError, match="'glm4_moe' computes none"):
            patch_grpo_trainer(trainer, mode=mode)
    with pytest.raises(AttributeError, match="num_experts"):  # ... and fails on it unpatched
        trainer.train()


def _ddp_worker(rank, port, path, results):
    """One of two gloo processes: unpatched, logps and chunked runs of the same MoE trainer with the aux loss."""
    from support.distributed import set_rank_environment

    set_rank_environment(rank, port)
    torch.set_num_threads(1)
    for mode in (None, "logps", "chunked"):
        trainer = _trainer(path, "qwen3_moe", ddp_backend="gloo", max_steps=2)
        patch = patch_grpo_trainer(trainer, mode=mode) if mode else None
        run = record_training(trainer)
        assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel"
        results[f"{mode}{rank}"] = dict(
            params=run.params,
            losses=run.losses,
            log=[{k: v for k, v in e.items() if k not in TIMING_KEYS} for e in run.log_history],
            checks=None if patch is None else [c.passed for c in patch.stats.self_checks],
            fallbacks=None if patch is None else patch.stats.fallback_calls,
        )


def test_two_process_ddp_with_aux_loss_matches_unpatched(tmp_path):
    """gloo DDP: logps mode calls the DDP-wrapped model (DDP averages the aux gradient with the rest), chunked mode
    averages after its own backward passes; both must end where unpatched DDP training ends."""
    import torch.multiprocessing as mp
    from support.distributed import free_port

    results = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(free_port(), tmp_path, results), nprocs=2, join=True)
    for rank in range(2):
        base = results[f"None{rank}"]
        assert any("aux_loss" in entry for entry in base["log"])
        for mode in ("logps", "chunked"):
            run = results[f"{mode}{rank}"]
            assert run["checks"] and all(run["checks"]) and run["fallbacks"] == 0
            assert run["losses"] == pytest.approx(base["losses"], rel=1e-4, abs=1e-6)
            assert _max_param_diff(run["params"], base["params"]) <= 1e-4, mode
            for entry, base_entry in zip(run["log"], base["log"], strict=True):
                assert entry == pytest.approx(base_entry, rel=1e-4, abs=1e-6)
