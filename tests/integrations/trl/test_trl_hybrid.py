"""The TRL plug-in on a tiny Qwen3.5 (a linear-attention hybrid), patched vs unpatched: the same log-probs (1e-5),
micro-batch losses and step-1 gradients (1e-4 relative), parameters after the steps (1e-4), the self-checks
passing and every prompt forwarded once."""

from __future__ import annotations

import pytest
import torch
import transformers
from packaging.version import Version

pytest.importorskip("trl")

from support.trl_tiny import hybrid_model, make_trainer, record_training, scripted_generate  # noqa: E402

from shared_prefix_logps.integrations.trl import patch_grpo_trainer  # noqa: E402
from shared_prefix_logps.recurrent.families import MIN_TRANSFORMERS  # noqa: E402

pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < MIN_TRANSFORMERS, reason=f"hybrids need transformers >= {MIN_TRANSFORMERS}"
)

# Two optimizer steps; temperature != 1, gradient accumulation over groups split across micro-batches, generation
# batches spanning two optimizer steps (the old policy's log-probs computed without gradients).
SETTINGS = dict(
    max_steps=2,
    temperature=0.7,
    per_device_train_batch_size=4,
    num_generations=4,
    gradient_accumulation_steps=2,
    steps_per_generation=4,
)


def _trainer(tmp_path):
    return make_trainer(tmp_path, model=hybrid_model(), **SETTINGS)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    monkeypatch = pytest.MonkeyPatch()
    try:
        scripted_generate(monkeypatch, truncated_calls=())
        return record_training(_trainer(tmp_path_factory.mktemp("base_qwen3_5")))
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("mode", ["logps", "chunked"])
def test_patched_trainer_on_qwen3_5_matches_unpatched(mode, baseline, tmp_path, monkeypatch):
    scripted_generate(monkeypatch, truncated_calls=())
    trainer = _trainer(tmp_path)
    patch = patch_grpo_trainer(trainer, mode=mode, generations_per_chunk=2)
    run = record_training(trainer)

    assert run.global_step == baseline.global_step == trainer.args.max_steps
    assert run.optimizer_steps == baseline.optimizer_steps and run.learning_rates == baseline.learning_rates
    expected = baseline.logps_calls if mode == "logps" else [c for c in baseline.logps_calls if not c[0]]
    assert len(run.logps_calls) == len(expected) > 0
    for (grad, ids, logps, _), (base_grad, base_ids, base_logps, _) in zip(run.logps_calls, expected):
        assert grad == base_grad and torch.equal(ids, base_ids)
        assert float((logps - base_logps).abs().max()) <= 1e-5
    for loss, base_loss in zip(run.losses, baseline.losses, strict=True):
        assert abs(loss - base_loss) <= 1e-4 * max(abs(base_loss), 1e-2), (run.losses, baseline.losses)
    assert run.first_grads.keys() == baseline.first_grads.keys()
    errors = {
        name: float((run.first_grads[name] - g).norm() / g.norm().clamp(min=1e-30))
        for name, g in baseline.first_grads.items()
    }
    assert max(errors.values()) <= 1e-4, max(errors.items(), key=lambda kv: kv[1])
    recurrent = [name for name in baseline.first_grads if "linear_attn" in name]
    assert recurrent and all(baseline.first_grads[name].norm() > 0 for name in recurrent)
    for name, value in baseline.params.items():
        torch.testing.assert_close(run.params[name], value, rtol=1e-4, atol=1e-4)

    stats = patch.stats
    assert stats.fallback_calls == 0 and not stats.fallback_reasons
    assert stats.self_checks and all(check.passed for check in stats.self_checks)
    assert stats.distinct_prompts < stats.rows and stats.tokens_forwarded < stats.dense_tokens
