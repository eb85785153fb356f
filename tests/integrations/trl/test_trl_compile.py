"""The TRL plug-in under TRL's compile option (``torch_compile=True``: accelerate compiles the model when the trainer
prepares it, whole or, with ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION=1, per repeated layer).

The patched, compiled trainer is compared with the unpatched, uncompiled one on the same data: per-token log-probs
within 1e-5 and every parameter gradient of the first step within 1e-4 relative. Before the compiled path was made
exact, the whole-model compilation's gradients were all zero in both modes (the log-probs, and so the plug-in's
self-check, were exact); the regional case covers accelerate's other form.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from support.trl_tiny import make_trainer, record_training  # noqa: E402

from shared_prefix_logps.integrations.trl import patch_grpo_trainer  # noqa: E402

SETTINGS = dict(max_steps=1, gradient_checkpointing=False)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    return record_training(make_trainer(tmp_path_factory.mktemp("base"), **SETTINGS))


@pytest.mark.parametrize(
    "mode, regional",
    [
        ("logps", False),
        pytest.param("chunked", False, marks=pytest.mark.slow),
        pytest.param("chunked", True, marks=pytest.mark.slow),
    ],
)
def test_patched_compiled_trainer_matches_unpatched(mode, regional, baseline, tmp_path, monkeypatch):
    torch._dynamo.reset()
    if regional:
        monkeypatch.setenv("ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION", "1")
    trainer = make_trainer(tmp_path, torch_compile=True, torch_compile_backend="aot_eager", **SETTINGS)
    patch = patch_grpo_trainer(trainer, mode=mode, generations_per_chunk=2)
    models = []
    logps_method = trainer._get_per_token_logps_and_entropies

    def spy(model, *args, **kwargs):
        models.append(model)
        return logps_method(model, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies = spy
    run = record_training(trainer)

    # The compiled model is what the plug-in served
    compiled_layers = [type(layer).__name__ for layer in trainer.model_wrapped.model.layers]
    if regional:
        assert compiled_layers == ["OptimizedModule"] * len(compiled_layers)
    else:
        assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert all(model is trainer.model_wrapped for model in models)
    assert models or mode == "chunked"
    assert patch.stats.fallback_calls == 0 and not patch.stats.fallback_reasons
    if mode == "chunked":
        assert patch.stats.chunked_steps == trainer.args.gradient_accumulation_steps

    # Chunked mode computes the policy's log-probs inside its backward; with one step and no reference model TRL
    # asks for no others, so only the gradients below compare what it computed.
    expected_calls = baseline.logps_calls if mode == "logps" else [c for c in baseline.logps_calls if not c[0]]
    assert len(run.logps_calls) == len(expected_calls)
    assert expected_calls or mode == "chunked"
    for (_, ids, logps, _), (_, base_ids, base_logps, _) in zip(run.logps_calls, expected_calls):
        assert torch.equal(ids, base_ids), "the runs generated different completions"
        assert float((logps - base_logps).abs().max()) <= 1e-5
    assert run.losses == pytest.approx(baseline.losses, rel=1e-4)
    assert run.first_grads.keys() == baseline.first_grads.keys() and baseline.first_grads
    errors = {
        name: float((run.first_grads[name] - grad).norm() / grad.norm()) for name, grad in baseline.first_grads.items()
    }
    assert max(errors.values()) <= 1e-4, max(errors.items(), key=lambda item: item[1])
