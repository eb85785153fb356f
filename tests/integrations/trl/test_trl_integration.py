"""patch_grpo_trainer against the unpatched TRL GRPOTrainer: same seeds, same data, both trainers built fresh.

Acceptance numbers (float32, tiny random Qwen2, CPU): per-token log-probs within 1e-5, every micro-batch loss and
every parameter gradient of step 1 within 1e-4 relative, parameters after 3 steps within 1e-4, identical
global_step, learning rates per step and optimizer step count; logged metrics equal to 1e-4.
"""

from __future__ import annotations

import os
import warnings
from importlib.metadata import version

import pytest
import torch

pytest.importorskip("trl")
if version("trl").startswith("1.15.") and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    # TRL 1.15's own fused log-prob head is a Triton kernel with no CPU path: the unpatched baseline cannot run
    pytest.skip(
        "TRL 1.15's GRPOTrainer needs Triton on the device; on CPU run with TRITON_INTERPRET=1",
        allow_module_level=True,
    )

from support.distributed import set_rank_environment  # noqa: E402
from support.trl_tiny import make_trainer, record_training, scripted_generate  # noqa: E402

from shared_prefix_logps.integrations.common import ddp as common_ddp  # noqa: E402
from shared_prefix_logps.integrations.common.rows import regroup_rows  # noqa: E402
from shared_prefix_logps.integrations.trl import (  # noqa: E402  # noqa: E402
    SelfCheckError,
    fp32_head,
    patch_grpo_trainer,
    unpatch_grpo_trainer,
)
from shared_prefix_logps.integrations.trl import chunked as trl_chunked  # noqa: E402
from shared_prefix_logps.integrations.trl import loss as trl_loss

# Each configuration runs 3 optimizer steps. Together they cover: beta > 0 with a separate reference model loaded
# from a path, beta > 0 with PEFT (reference = disabled adapter), temperature != 1, entropy masking
# (top_entropy_quantile < 1), entropy bonus, num_generations > per-device batch (groups split over micro-batches),
# gradient accumulation 2, steps_per_generation > GA (old log-probs computed, ratios != 1), num_iterations 2,
# gradient checkpointing, loss types dapo / grpo / bnpo, and chunks of 1 and 2 generations.
CONFIGS = {
    "ref_entropy_mask": dict(
        kind="ref",
        beta=0.04,
        temperature=0.7,
        top_entropy_quantile=0.6,
        num_generations=8,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        gradient_checkpointing=True,
    ),
    "peft_ref_entropy_bonus": dict(
        kind="peft", beta=0.04, loss_type="grpo", gradient_accumulation_steps=2, entropy_coef=0.01
    ),
    "bnpo_two_iterations": dict(kind="plain", loss_type="bnpo", num_iterations=2, temperature=1.3, epsilon=0.05),
}
GENERATIONS_PER_CHUNK = {"ref_entropy_mask": 1, "peft_ref_entropy_bonus": 1, "bnpo_two_iterations": 2}
TIMING_KEYS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


@pytest.fixture(scope="module")
def baselines(tmp_path_factory):
    """Unpatched runs, computed once per configuration and shared by both modes."""
    cache = {}

    def get(name):
        if name not in cache:
            path = tmp_path_factory.mktemp(f"base_{name}")
            cache[name] = record_training(make_trainer(path, **CONFIGS[name]))
        return cache[name]

    return get


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


@pytest.mark.parametrize("mode", ["logps", "chunked"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_patched_trainer_matches_unpatched(name, mode, baselines, tmp_path):
    base = baselines(name)
    trainer = make_trainer(tmp_path, **CONFIGS[name])
    patch = patch_grpo_trainer(trainer, mode=mode, generations_per_chunk=GENERATIONS_PER_CHUNK[name])
    run = record_training(trainer)

    # Steps, schedule and optimizer: untouched by the patch
    assert run.global_step == base.global_step == trainer.args.max_steps
    assert run.optimizer_steps == base.optimizer_steps == trainer.args.max_steps
    assert run.learning_rates == base.learning_rates

    # Log-probs TRL received, call by call (chunked mode: the policy's go through chunked_backward instead)
    expected_calls = base.logps_calls if mode == "logps" else [c for c in base.logps_calls if not c[0]]
    assert len(run.logps_calls) == len(expected_calls) > 0
    worst = 0.0
    for (grad, ids, logps, entropies), (base_grad, base_ids, base_logps, base_entropies) in zip(
        run.logps_calls, expected_calls
    ):
        assert grad == base_grad
        assert torch.equal(ids, base_ids), "the runs generated different completions"
        assert logps.dtype == base_logps.dtype == torch.float32
        worst = max(worst, float((logps - base_logps).abs().max()))
        assert (entropies is None) == (base_entropies is None)
        if entropies is not None:
            assert float((entropies - base_entropies).abs().max()) <= 1e-5
    assert worst <= 1e-5

    # Every micro-batch loss, every gradient of step 1, parameters after 3 steps
    assert len(run.losses) == len(base.losses)
    for loss, base_loss in zip(run.losses, base.losses):
        assert abs(loss - base_loss) <= 1e-4 * max(abs(base_loss), 1e-2), (run.losses, base.losses)
    assert run.first_grads.keys() == base.first_grads.keys() and base.first_grads
    errors = {n: _relative(run.first_grads[n], base.first_grads[n]) for n in base.first_grads}
    assert max(errors.values()) <= 1e-4, max(errors.items(), key=lambda kv: kv[1])
    for n, value in base.params.items():
        torch.testing.assert_close(run.params[n], value, rtol=1e-4, atol=1e-4)

    # Logged metrics (entropy, kl, clip ratios, loss ...) as the unpatched trainer logged them
    assert len(run.log_history) == len(base.log_history)
    for entry, base_entry in zip(run.log_history, base.log_history):
        assert entry.keys() == base_entry.keys()
        for key, value in base_entry.items():
            if key not in TIMING_KEYS and isinstance(value, float):
                assert entry[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key

    # What the patch did
    stats = patch.stats
    assert stats.fallback_calls == 0 and not stats.fallback_reasons
    assert stats.self_checks and all(check.passed for check in stats.self_checks)
    assert stats.distinct_prompts < stats.rows and stats.tokens_forwarded < stats.dense_tokens
    if mode == "chunked":
        micro_batches = trainer.args.max_steps * trainer.args.gradient_accumulation_steps
        assert stats.chunked_steps == micro_batches
        assert stats.max_loss_discrepancy <= 1e-6


@pytest.fixture
def trainer(tmp_path):
    return make_trainer(tmp_path, temperature=0.7)


def _batch(trainer, rows=6, prompt=5, completion=4, seed=0):
    """Trainer-shaped rows: left-padded prompts (two distinct), right-padded completions (one empty)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompts = torch.randint(3, vocab, (2, prompt), generator=gen)
    prompt_ids = prompts[torch.arange(rows) % 2]
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1::2, :2] = 0
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(3, vocab, (rows, completion), generator=gen)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[0, 2:] = 0
    completion_mask[1, :] = 0
    return torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), completion


def test_returns_what_trl_returns(trainer):
    input_ids, attention_mask, keep = _batch(trainer)
    original = trainer._get_per_token_logps_and_entropies
    expected = original(trainer.model, input_ids, attention_mask, keep, compute_entropy=True)
    patch_grpo_trainer(trainer)
    got = trainer._get_per_token_logps_and_entropies(
        trainer.model, input_ids, attention_mask, keep, compute_entropy=True
    )
    assert isinstance(got, tuple) and len(got) == len(expected) == 3
    for ours, theirs in zip(got[:2], expected[:2]):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
        assert ours.requires_grad and theirs.requires_grad
        assert float((ours - theirs).detach().abs().max()) <= 1e-5
    assert got[2] is None and expected[2] is None
    masked = attention_mask[:, -keep:] == 0
    assert bool((got[0][masked] == 0).all()) and bool((got[1][masked] == 0).all())
    with torch.no_grad():  # positional batch_size, as the old/ref calls pass it by keyword
        plain = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, keep, 2)
    assert plain[1] is None and not plain[0].requires_grad
    assert float((plain[0] - expected[0]).detach().abs().max()) <= 1e-5


def test_falls_back_for_inputs_it_cannot_handle_with_one_warning(trainer):
    patch = patch_grpo_trainer(trainer, self_check=False)
    input_ids, attention_mask, keep = _batch(trainer)
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return ("original",)

    patch.logps.original = spy
    method = trainer._get_per_token_logps_and_entropies
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert method(trainer.model, input_ids, attention_mask, keep, pixel_values=torch.zeros(1)) == ("original",)
        assert method(trainer.model, input_ids, attention_mask, keep, compute_aux_loss=True) == ("original",)
        empty_prompt = attention_mask.clone()
        empty_prompt[0, : input_ids.shape[1] - keep] = 0
        assert method(trainer.model, input_ids, empty_prompt, keep) == ("original",)
    messages = [str(w.message) for w in caught if "falling back" in str(w.message)]
    assert len(messages) == 3 and "pixel_values" in messages[0]
    assert len(calls) == 4 and patch.stats.fallback_calls == 4 and patch.stats.shared_calls == 0


def test_self_check_raises_on_mismatch(trainer):
    """TRL's fused head divides by the temperature it got at construction; a trainer whose ``temperature`` differs
    from it (here changed afterwards) would make the two paths disagree, and the self-check must say so."""
    input_ids, attention_mask, keep = _batch(trainer)
    patch_grpo_trainer(trainer)
    trainer.temperature = 1.0
    with pytest.raises(SelfCheckError, match="self-check failed"):
        trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, keep)


def test_chunked_self_check_catches_a_wrong_loss(tmp_path, monkeypatch):
    real = trl_loss.micro_batch_counts

    def doubled(*args, **kwargs):
        counts = real(*args, **kwargs)
        return {**counts, "num_items_in_batch": counts["num_items_in_batch"] * 2}

    monkeypatch.setattr(trl_loss, "micro_batch_counts", doubled)
    trainer = make_trainer(tmp_path, max_steps=1)
    patch_grpo_trainer(trainer, mode="chunked")
    with pytest.raises(SelfCheckError, match="does not reproduce TRL"):
        trainer.train()


def test_unpatch_restores_the_trainer(trainer):
    cls = type(trainer)
    own_loss = trainer.compute_loss  # an instance attribute of the user's: kept through patch and unpatch
    trainer.compute_loss = own_loss
    patch_grpo_trainer(trainer, mode="chunked")
    replaced = ("_get_per_token_logps_and_entropies", "compute_loss")
    assert all(name in trainer.__dict__ for name in replaced) and trainer.compute_loss is not own_loss
    assert "backward" in trainer.accelerator.__dict__ and "training_step" not in trainer.__dict__
    with pytest.raises(ValueError, match="patched already"):
        patch_grpo_trainer(trainer)
    unpatch_grpo_trainer(trainer)
    assert "_get_per_token_logps_and_entropies" not in trainer.__dict__ and trainer.__dict__["compute_loss"] is own_loss
    assert "backward" not in trainer.accelerator.__dict__ and "training_step" not in trainer.__dict__
    assert trainer._get_per_token_logps_and_entropies.__func__ is cls._get_per_token_logps_and_entropies
    with pytest.raises(ValueError, match="not patched"):
        unpatch_grpo_trainer(trainer)
    patch_grpo_trainer(trainer)  # patchable again


def test_bad_options_and_unsupported_chunked_setups(trainer, tmp_path):
    with pytest.raises(ValueError, match="mode"):
        patch_grpo_trainer(trainer, mode="fast")
    with pytest.raises(ValueError, match="generations_per_chunk"):
        patch_grpo_trainer(trainer, mode="chunked", generations_per_chunk=0)
    with pytest.raises(TypeError, match="GRPOTrainer"):
        patch_grpo_trainer(object())

    from trl import GRPOTrainer

    class CustomLoss(GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs) * 2

    custom = make_trainer(tmp_path, trainer_class=CustomLoss)
    with pytest.raises(NotImplementedError, match="overrides _compute_loss"):
        patch_grpo_trainer(custom, mode="chunked")
    patch_grpo_trainer(custom)  # the log-prob patch does not depend on the loss


def test_fp32_lm_head_under_bf16_autocast(tmp_path, monkeypatch):
    """``cast_lm_head_to_fp32`` runs TRL's head in float32 outside autocast; the shared path's head must too."""
    from shared_prefix_logps.kernels import fused_head as head

    # transformers 4.x TrainingArguments exports its precision as ACCELERATE_MIXED_PRECISION; without this the
    # variable outlives the test and later trainers (the DDP test's spawned workers too) run under bf16 autocast.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    trainer = make_trainer(tmp_path, bf16=True, cast_lm_head_to_fp32=True, temperature=0.7)
    assert trainer.accelerator.mixed_precision == "bf16"
    input_ids, attention_mask, keep = _batch(trainer, rows=8, prompt=8, completion=6)
    with torch.no_grad():
        expected = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, keep)[0]
    patch = patch_grpo_trainer(trainer)
    assert len(patch.fp32_heads) == 1
    seen = []
    real = head.linear_logps

    def spy(hidden, weight, *args, **kwargs):
        seen.append((hidden.dtype, weight.dtype, torch.is_autocast_enabled("cpu")))
        return real(hidden, weight, *args, **kwargs)

    monkeypatch.setattr(head, "linear_logps", spy)
    with torch.no_grad():
        ours = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, keep)[0]
        # The head runs in each node call (the prompts' last tokens predict the completions' first): float32, off
        # autocast, in both.
        assert seen == [(torch.float32, torch.float32, False)] * 2
        fp32_head.remove_fp32_head(patch.fp32_heads[0])  # what the head would do without the shim
        trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask, keep)
        assert seen[2][2] is True  # under autocast: a bfloat16 matmul
    assert patch.stats.self_checks[0].passed
    valid = attention_mask[:, -keep:] != 0
    assert float((ours - expected).abs()[valid].mean()) <= 0.02  # bf16 body rounding only


def test_regroup_rows_makes_consecutive_groups_from_shuffled_partial_ones():
    prompts = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [1, 5, 6], [7, 8, 9], [0, 5, 6], [0, 0, 4]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1], [0, 1, 1], [0, 0, 1]])
    buckets = regroup_rows(prompts, mask)
    assert [(f.tolist(), r.tolist()) for f, r in buckets] == [
        ([6, 3], [6, 3]),  # two prompts with one row each ([1, 5, 6] differs from the padded [_, 5, 6])
        ([1], [1, 4]),
        ([0], [0, 2, 5]),
    ]
    covered = torch.cat([rows for _, rows in buckets]).sort().values
    assert covered.tolist() == list(range(len(prompts)))


def _ddp_worker(rank, port, path, results):
    """One of two gloo processes: unpatched, logps and chunked runs of the same trainer, one after the other."""
    set_rank_environment(rank, port)
    torch.set_num_threads(1)
    config = dict(
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        temperature=0.7,
        top_entropy_quantile=0.6,  # quantile gathered over both processes
        ddp_backend="gloo",
    )
    from unittest import mock

    from trl import GRPOTrainer

    for mode in (None, "logps", "chunked"):
        trainer = make_trainer(path, **config)
        patch = patch_grpo_trainer(trainer, mode=mode) if mode else None
        # a class-level patch of training_step (as TRL's tests do) must still see every micro-batch
        with (
            mock.patch.object(
                GRPOTrainer, "training_step", autospec=True, side_effect=GRPOTrainer.training_step
            ) as step,
            mock.patch.object(trl_chunked, "average_gradients", side_effect=common_ddp.average_gradients) as averaging,
        ):
            run = record_training(trainer)
        assert type(trainer.model_wrapped).__name__ == "DistributedDataParallel"
        results[f"{mode}{rank}"] = dict(
            grads=run.first_grads,
            params=run.params,
            losses=run.losses,
            lrs=run.learning_rates,
            steps=(run.global_step, run.optimizer_steps),
            log=[{k: v for k, v in e.items() if k not in TIMING_KEYS} for e in run.log_history],
            checks=None if patch is None else [c.passed for c in patch.stats.self_checks],
            class_steps=step.call_count,
            manual_averaging=averaging.call_count,
        )


def test_two_process_ddp_matches_unpatched(tmp_path):
    """gloo DDP with transformers' default find_unused_parameters=True: the result must equal unpatched DDP training.

    ``logps`` mode calls the DDP-wrapped model as TRL does, so DDP reduces the gradients itself (no manual averaging);
    ``chunked`` mode bypasses DDP's forward and averages at the accumulation boundary (several backwards per step)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_ddp_worker, args=(port, tmp_path, results), nprocs=2, join=True)
    for rank in range(2):
        base = results[f"None{rank}"]
        for mode in ("logps", "chunked"):
            run = results[f"{mode}{rank}"]
            assert run["checks"] and all(run["checks"])
            assert run["steps"] == base["steps"] == (3, 3) and run["lrs"] == base["lrs"]
            assert run["class_steps"] == base["class_steps"] == 6
            assert (run["manual_averaging"] == 0) == (mode == "logps"), (mode, run["manual_averaging"])
            assert run["losses"] == pytest.approx(base["losses"], rel=1e-4, abs=1e-6)
            errors = [_relative(run["grads"][n], g) for n, g in base["grads"].items()]
            assert max(errors) <= 1e-4, (mode, max(errors))
            for n, value in base["params"].items():
                torch.testing.assert_close(run["params"][n], value, rtol=1e-4, atol=1e-4)
                # DDP keeps the replicas identical
                torch.testing.assert_close(run["params"][n], results[f"{mode}{1 - rank}"]["params"][n])
            for entry, base_entry in zip(run["log"], base["log"], strict=True):
                assert entry == pytest.approx(base_entry, rel=1e-4, abs=1e-6)


def test_example_script_runs(monkeypatch, capsys):
    import pathlib
    import runpy

    script = pathlib.Path(__file__).resolve().parents[3] / "examples" / "grpo_tiny_cpu.py"
    monkeypatch.setattr("sys.argv", [str(script), "--mode", "chunked", "--steps", "1"])
    runpy.run_path(str(script), run_name="__main__")
    out = capsys.readouterr().out
    assert "mode=chunked: 1 optimizer steps" in out and "fallbacks: 0" in out
    assert "passed" in out and "FAILED" not in out


def test_chunked_mode_forwards_a_few_generations_at_a_time(tmp_path):
    """With G = 8 completions of one prompt per micro-batch and 2 generations per chunk, every forward with
    gradient holds at most 2 rows' tokens (the prompt's node call once, then 4 chunks of 2 completions, each call's
    tokens packed): activations do not grow with G."""
    trainer = make_trainer(tmp_path, num_generations=8, per_device_train_batch_size=8, max_steps=2)
    patch = patch_grpo_trainer(trainer, mode="chunked", generations_per_chunk=2)
    shapes = []

    def hook(module, args):
        if torch.is_grad_enabled():
            shapes.append(tuple(args[0].shape))

    handle = trainer.model.get_input_embeddings().register_forward_pre_hook(hook)
    try:
        trainer.train()
    finally:
        handle.remove()
    assert patch.stats.chunked_steps == 2
    assert len(shapes) == 2 * (1 + 4) and all(rows == 1 for rows, _ in shapes), shapes  # packed node calls
    chunks = [tokens for i, (_, tokens) in enumerate(shapes) if i % 5]  # after each step's prompts' call
    assert all(tokens <= 2 * trainer.args.max_completion_length for tokens in chunks), shapes


@pytest.mark.parametrize("truncated_step", [1, 2])
@pytest.mark.parametrize("mode", ["logps", "chunked"])
def test_all_masked_micro_batch_steps_like_unpatched(mode, truncated_step, tmp_path, monkeypatch):
    """``mask_truncated_completions=True`` and every completion of one step truncated: that micro-batch's loss is a
    constant 0. Unpatched TRL still back-propagates it, so every parameter gets a zero ``.grad`` and Adam moves every
    parameter by its momentum (and counts the step). The patched trainer must do the same: not crash (no graph), and
    not skip the step for lack of ``.grad``. When it is the first step, the self-checks wait for the next one."""
    config = dict(mask_truncated_completions=True, max_steps=3)
    scripted_generate(monkeypatch, truncated_calls={truncated_step - 1})
    base = record_training(make_trainer(tmp_path / "base", **config))
    scripted_generate(monkeypatch, truncated_calls={truncated_step - 1})
    trainer = make_trainer(tmp_path / "patched", **config)
    patch = patch_grpo_trainer(trainer, mode=mode)
    run = record_training(trainer)

    assert any(entry.get("completions/clipped_ratio") == 1.0 for entry in base.log_history)
    assert run.global_step == base.global_step == 3 and run.optimizer_steps == base.optimizer_steps == 3
    assert run.losses == pytest.approx(base.losses, rel=1e-4, abs=1e-7) and run.losses[truncated_step - 1] == 0.0
    # Skipping the all-masked step moved parameters by 8.6e-4 (truncated_step=2); float noise stays below 1e-4
    worst = max(float((run.params[n] - value).abs().max()) for n, value in base.params.items())
    assert worst <= 1e-4, worst
    stats = patch.stats
    assert stats.fallback_calls == 0 and all(check.passed for check in stats.self_checks)
    if mode == "chunked":
        assert {check.what for check in stats.self_checks} >= {
            "chunked logps (grad)",
            "chunked loss gradient (relative)",
        }
        if truncated_step == 1:
            assert stats.trivial_self_checks == {
                "chunked loss gradient (TRL's gradient is zero)": 1,
                "chunked logps (no valid token)": 1,
            }
    else:
        assert "logps (grad)" in {check.what for check in stats.self_checks}
        if truncated_step == 1:
            assert stats.trivial_self_checks == {"logps (grad) (no valid token)": 1}


@pytest.mark.parametrize("mode", ["logps", "chunked"])
def test_class_level_training_step_patch_still_runs(mode, tmp_path):
    """``patch.object(GRPOTrainer, "training_step", ...)`` (as TRL's own tests mock it) must still see every
    micro-batch: the plug-in installs no ``training_step`` of its own on the instance, which would shadow the class."""
    from unittest import mock

    from trl import GRPOTrainer

    trainer = make_trainer(tmp_path, max_steps=2, gradient_accumulation_steps=2)
    patch = patch_grpo_trainer(trainer, mode=mode)
    with mock.patch.object(GRPOTrainer, "training_step", autospec=True, side_effect=GRPOTrainer.training_step) as step:
        trainer.train()
    assert step.call_count == 4 and all(call.args[0] is trainer for call in step.call_args_list)
    assert "training_step" not in trainer.__dict__
    assert trainer.state.global_step == 2
    if mode == "chunked":
        assert patch.stats.chunked_steps == 4


def _flat_first_rewards(prompts, completions, **kwargs):
    """:func:`trl_tiny.reward_len`, except that the first generation batch gets the same reward everywhere: its
    advantages, hence TRL's loss and its gradient, are exactly 0 (beta = 0)."""
    from support.trl_tiny import reward_len

    _flat_first_rewards.calls += 1
    return [0.0] * len(completions) if _flat_first_rewards.calls == 1 else reward_len(prompts, completions)


def test_chunked_loss_check_waits_for_a_non_zero_gradient(tmp_path):
    """A first micro-batch whose loss gradient is exactly 0 compares nothing: the loss-gradient self-check must not be
    spent on it, but run on the first micro-batch with a non-zero gradient (and the skip be recorded)."""
    _flat_first_rewards.calls = 0
    trainer = make_trainer(tmp_path, max_steps=2, reward_func=_flat_first_rewards)
    patch = patch_grpo_trainer(trainer, mode="chunked")
    trainer.train()
    loss_checks = [c for c in patch.stats.self_checks if c.what.startswith("chunked loss gradient")]
    assert patch.stats.trivial_self_checks == {"chunked loss gradient (TRL's gradient is zero)": 1}
    assert len(loss_checks) == 1 and loss_checks[0].passed
    assert "postponed" in patch.stats.summary()


def test_chunked_self_check_catches_a_wrong_loss_after_a_zero_gradient_micro_batch(tmp_path, monkeypatch):
    real = trl_loss.micro_batch_counts

    def doubled(*args, **kwargs):
        counts = real(*args, **kwargs)
        return {**counts, "num_items_in_batch": counts["num_items_in_batch"] * 2}

    monkeypatch.setattr(trl_loss, "micro_batch_counts", doubled)
    _flat_first_rewards.calls = 0
    trainer = make_trainer(tmp_path, max_steps=2, reward_func=_flat_first_rewards)
    patch_grpo_trainer(trainer, mode="chunked")
    with pytest.raises(SelfCheckError, match="does not reproduce TRL"):
        trainer.train()
    assert trainer.state.global_step == 1  # caught in the second step


@pytest.mark.parametrize("mode", ["logps", "chunked"])
def test_float64_default_dtype_and_numpy_options(mode, tmp_path):
    """Under ``torch.set_default_dtype(torch.float64)`` with the float32 model, and with a numpy
    ``generations_per_chunk``, the patched step runs and passes its self-check against TRL's own."""
    np = pytest.importorskip("numpy")
    trainer = make_trainer(tmp_path, max_steps=1)
    patch = patch_grpo_trainer(trainer, mode=mode, generations_per_chunk=np.int64(2))
    assert type(patch.generations_per_chunk) is int
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        trainer.train()
    finally:
        torch.set_default_dtype(previous)
    assert patch.stats.fallback_calls == 0 and patch.stats.shared_calls > 0
    if mode == "chunked":
        assert patch.stats.chunked_steps == 1
