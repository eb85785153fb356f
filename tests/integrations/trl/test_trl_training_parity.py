"""A whole training run: TRL's GRPOTrainer for 20 optimizer steps with AdamW, unpatched against patched (``logps`` and
``chunked`` modes), same seed and data, float32. Per step the loss agrees within 1e-5 and the learning rate exactly;
the final parameters agree within 1e-5 relative, tensor by tensor. Once with prompts that share nothing but their
words, once with prompts behind a common 70-word system prompt, which the patched calls forward once (the searched
trie, one level deeper than the two-level one).

The loss depends on the log-probs' values (``beta`` > 0 against a reference model, two iterations per generation
batch so the old policy's log-probs enter the ratio), or the comparison could not fail: at ``beta`` = 0 with one
iteration, GRPO's loss value is the same whatever the log-probs. Completions are scripted, the same in both runs (a
sampled generation would diverge at its first near-tie once the parameters differ by rounding). The model's
attention biases start random instead of at zero, so that every tensor's relative error compares updates with a
parameter of real size (a zero-initialized bias holds only 20 steps of updates, whose rounding differences are a
larger share of it).
"""

from __future__ import annotations

import os
from importlib.metadata import version

import pytest
import torch

pytest.importorskip("trl")
if version("trl").startswith("1.15.") and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("TRL 1.15's GRPOTrainer needs Triton on the device", allow_module_level=True)

from support.trl_tiny import PROMPTS, WORDS, build_model, make_trainer, record_training, scripted_generate  # noqa: E402

from shared_prefix_logps.engine import run  # noqa: E402
from shared_prefix_logps.integrations.trl import patch_grpo_trainer  # noqa: E402

STEPS = 20
SYSTEM_PROMPT = " ".join((WORDS * 4)[:70])
DATASETS = {"distinct": None, "system_prompt": [f"{SYSTEM_PROMPT} {prompt}" for prompt in PROMPTS] * 5}
SETTINGS = dict(kind="ref", max_steps=STEPS, beta=0.04, num_iterations=2, optim="adamw_torch")


def _model():
    """The tiny Qwen2 policy with its attention biases drawn like its weights (see the module docstring)."""
    model = build_model(0)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    return model


def _train(tmp_path, monkeypatch, dataset: str, mode: str | None):
    """(record, patch handle or None, calls that shared the system prompt) of one 20-step run."""
    scripted_generate(monkeypatch, truncated_calls=set())
    tree_calls = []  # grouped calls that took the searched trie (the system prompt one node, one level deeper)
    pays = run.deeper_sharing_pays

    def spy(*args, **kwargs):
        deeper = pays(*args, **kwargs)
        tree_calls.extend([1] if deeper else [])
        return deeper

    monkeypatch.setattr(run, "deeper_sharing_pays", spy)
    trainer = make_trainer(tmp_path, model=_model(), prompts=DATASETS[dataset], **SETTINGS)
    patch = None if mode is None else patch_grpo_trainer(trainer, mode=mode, generations_per_chunk=2)
    return record_training(trainer), patch, len(tree_calls)


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """The unpatched run per dataset, computed once."""
    cache = {}

    def get(dataset):
        if dataset not in cache:
            with pytest.MonkeyPatch.context() as monkeypatch:
                cache[dataset] = _train(tmp_path_factory.mktemp(f"base_{dataset}"), monkeypatch, dataset, None)[0]
        return cache[dataset]

    return get


@pytest.mark.parametrize("mode", ["logps", "chunked"])
@pytest.mark.parametrize("dataset", list(DATASETS))
def test_twenty_adamw_steps_match_the_unpatched_trainer(dataset, mode, baselines, tmp_path, monkeypatch):
    base = baselines(dataset)
    run, patch, tree_calls = _train(tmp_path, monkeypatch, dataset, mode)

    assert patch.stats.shared_calls > 0 and patch.stats.fallback_calls == 0, patch.stats
    if dataset == "system_prompt":
        assert tree_calls > 0, "the patched calls did not share the system prompt (no deeper trie)"
    assert run.optimizer_steps == base.optimizer_steps == run.global_step == STEPS
    assert len(run.learning_rates) == STEPS and run.learning_rates == base.learning_rates
    # The loss moves with the log-probs: a check of it can fail.
    assert len(base.losses) == STEPS and max(base.losses) - min(base.losses) > 1e-2, base.losses
    loss_errors = [abs(loss - base_loss) for loss, base_loss in zip(run.losses, base.losses)]
    assert len(run.losses) == STEPS and max(loss_errors) <= 1e-5, loss_errors
    assert run.params.keys() == base.params.keys()
    errors = {name: float((run.params[name] - value).norm() / value.norm()) for name, value in base.params.items()}
    moved = max(float((value - _model().state_dict()[name]).norm()) for name, value in base.params.items())
    assert moved > 1e-2  # the parameters did train
    assert max(errors.values()) <= 1e-5, max(errors.items(), key=lambda item: item[1])
