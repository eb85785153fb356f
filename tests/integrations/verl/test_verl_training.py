"""verl's ``forward_backward_batch`` with its own ``ppo_loss`` through the patched ``FSDPEngineWithLMHead`` (FSDP2,
one gloo process, CPU): every micro-batch's loss, every metric and every parameter's gradient as the unpatched
engine computes them, in each loss aggregation mode, with and without remove-padding."""

from __future__ import annotations

import pytest

pytest.importorskip("verl")

import torch  # noqa: E402
from support import verl_setup as vs  # noqa: E402


@pytest.fixture(scope="module")
def engines(process_group, tmp_path_factory):
    """Patched and unpatched twins; micro-batches of 3 rows split the groups of 4 (shuffled or not)."""
    from shared_prefix_logps.integrations.verl import unpatch_verl_engine

    path = vs.save_model(tmp_path_factory.mktemp("llama"), "llama")
    patched, unpatched = (vs.build_engine(path, micro_batch_size=3) for _ in range(2))
    unpatch_verl_engine(unpatched)
    return patched, unpatched


def compare(engines, loss_fn, *, remove_padding=True, calculate_entropy=True, micro_batches=4, **batch):
    results = []
    for engine in engines:
        td = vs.batch_options(engine, vs.rollout_batch(**batch), infer=False, calculate_entropy=calculate_entropy)
        vs.assign(td, use_remove_padding=remove_padding)
        results.append(vs.forward_backward(engine, td, loss_fn))
    (ours, our_grads), (theirs, their_grads) = results
    assert len(ours["loss"]) == len(theirs["loss"]) == micro_batches  # 12 rows in micro-batches of 3 by default
    losses = torch.tensor(ours["loss"], dtype=torch.float64), torch.tensor(theirs["loss"], dtype=torch.float64)
    assert torch.allclose(*losses, rtol=1e-5, atol=1e-7), losses
    vs.assert_metrics_close(ours["metrics"], theirs["metrics"])
    worst = vs.gradient_error(our_grads, their_grads)
    assert worst < 1e-4, worst
    return worst


@pytest.mark.parametrize("remove_padding", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_ppo_loss_modes(engines, agg_mode, remove_padding):
    """Entropy bonus and KL loss on; shuffled rows, groups split across micro-batches, responses of 1 token and of
    the full width, a one-token prompt, tool tokens out of the loss mask."""
    loss_fn = vs.ppo_loss(loss_agg_mode=agg_mode, entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    compare(engines, loss_fn, remove_padding=remove_padding, shuffle=True, seed=21)


def test_plain_policy_gradient_groups_in_order(engines):
    """No entropy (``calculate_entropy=False``), no KL; groups in order (micro-batches of 3 still split them)."""
    loss_fn = vs.ppo_loss(loss_agg_mode="token-mean")
    compare(engines, loss_fn, calculate_entropy=False, shuffle=False, seed=22)


def test_one_token_responses(engines):
    """Every response a single token, filling the response width (no right padding at all)."""
    loss_fn = vs.ppo_loss(loss_agg_mode="seq-mean-token-mean", entropy_coeff=0.01)
    compare(engines, loss_fn, shuffle=True, seed=23, response_len=1, tool_tokens=False, num_prompts=2, generations=6)


def test_per_row_temperature(engines):
    """verl's per-sample temperature (a tensor in the batch): one shared-path call per distinct value, gradients of
    the sum as verl's single forward gives them."""
    loss_fn = vs.ppo_loss(loss_agg_mode="token-mean", entropy_coeff=0.01)
    temperature = torch.tensor([0.6, 1.0, 1.4])[torch.arange(12) // 4]
    compare(engines, loss_fn, shuffle=True, seed=24, temperature=temperature)


@pytest.mark.parametrize("variant", ["checkpointing", "lora"])
def test_checkpointing_and_lora(process_group, tmp_path, variant):
    """verl's defaults for its actor: non-reentrant gradient checkpointing; and a LoRA adapter (its gradients only)."""
    from shared_prefix_logps.integrations.verl import unpatch_verl_engine

    path = vs.save_model(tmp_path, "qwen2")
    options = dict(gradient_checkpointing=True) if variant == "checkpointing" else dict(lora_rank=4)
    pair = [vs.build_engine(path, micro_batch_size=3, **options) for _ in range(2)]
    unpatch_verl_engine(pair[1])
    if variant == "lora":
        for engine in pair:
            vs.randomize_lora(engine)
    loss_fn = vs.ppo_loss(loss_agg_mode="seq-mean-token-sum", entropy_coeff=0.01, use_kl_loss=True)
    compare(pair, loss_fn, shuffle=True, seed=25)


def test_dynamic_batch_size(process_group, tmp_path):
    """``use_dynamic_bsz``: verl packs the (shuffled) rows into micro-batches of at most 48 tokens balanced by
    workload (3 here), and restores the row order afterwards."""
    from shared_prefix_logps.integrations.verl import unpatch_verl_engine

    path = vs.save_model(tmp_path, "qwen2")
    pair = [vs.build_engine(path, dynamic_bsz=True, max_token_len=48) for _ in range(2)]
    unpatch_verl_engine(pair[1])
    loss_fn = vs.ppo_loss(loss_agg_mode="token-mean", entropy_coeff=0.01, use_kl_loss=True)
    compare(pair, loss_fn, shuffle=True, seed=26, micro_batches=3)
