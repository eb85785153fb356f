"""The patched Actor under DeepSpeed ZeRO-3 on two gloo processes with different rows (different prompt counts and
shapes, one process also falling back on one call), as OpenRLHF's strategy wraps it (``actor.model`` replaced by the
engine): no-grad and grad log-probs against the unpatched single-process Actor on each rank's rows within 1e-5, every
full gradient of OpenRLHF's PolicyLoss against the mean over ranks of the unpatched gradients within 1e-4 relative."""

from __future__ import annotations

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (make test-openrlhf)")
import torch
import torch.multiprocessing as mp
from support.distributed import free_port, init_deepspeed_gloo, set_rank_environment
from support.openrlhf_setup import import_openrlhf, make_actor, openrlhf_rows

deepspeed = pytest.importorskip("deepspeed")

CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    # no persistent parameters: tiny ones would otherwise stay gathered after the first forward, and processes making
    # different model calls would not show
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "fp16": {"enabled": False},
    "bf16": {"enabled": False},
    "steps_per_print": 10**9,
}


def _rows(rank):
    return openrlhf_rows(2 + rank, 2, seed=10 + rank, multi_turn=rank == 1)


def _advantages(actions, rank):
    gen = torch.Generator().manual_seed(rank)
    return torch.randn((actions.shape[0], 1), generator=gen).expand_as(actions) * actions


def _loss(actor, sequences, attention, actions, old, advantages):
    models = import_openrlhf()
    loss_fn = models.PolicyLoss(clip_eps_low=0.2, clip_eps_high=0.28, token_level_loss=True)
    log_probs, output = actor(sequences, actions, attention, return_output=True, return_entropy=True)
    loss = loss_fn(log_probs, old, advantages, action_mask=actions)[0]
    return log_probs, loss - 0.01 * models.aggregate_loss(output.entropy[:, -actions.shape[1] :], actions)


def _worker(rank, port, results):
    set_rank_environment(rank, port)
    torch.set_num_threads(1)
    init_deepspeed_gloo()
    from deepspeed.utils import safe_get_full_grad

    from shared_prefix_logps.integrations.openrlhf import patch_actor

    try:
        actor = make_actor(temperature=0.9)
        names = [name for name, _ in actor.model.named_parameters()]
        optimizer = torch.optim.SGD(actor.model.parameters(), lr=0.0)
        actor.model, *_ = deepspeed.initialize(model=actor.model, optimizer=optimizer, config=CONFIG)
        patch = patch_actor(actor)
        assert patch.lockstep is not None
        sequences, attention, actions = _rows(rank)
        with torch.no_grad():
            scored = actor(sequences, actions, attention)
            hole = attention.clone()
            hole[0, 1] = int(rank == 0)  # rank 1's first row has padding inside: both processes fall back
            actor(sequences, actions, hole)
        old = scored + 0.05 * actions
        log_probs, loss = _loss(actor, sequences, attention, actions, old, _advantages(actions, rank))
        actor.model.backward(loss)
        params = dict(actor.model.module.named_parameters())
        grads = {name: safe_get_full_grad(params[name]).detach().clone() for name in names}
        actor.model.step()
        results[rank] = dict(
            scored=scored,
            log_probs=log_probs.detach(),
            grads=grads,
            fallbacks=dict(patch.stats.fallback_reasons),
            checks=[check.passed for check in patch.stats.self_checks],
        )
        deepspeed.comm.barrier()
    finally:
        torch.distributed.destroy_process_group()


def test_zero3_two_processes_match_unpatched(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), results), nprocs=2, join=True)
    reference = make_actor(temperature=0.9)
    grads = []
    for rank in range(2):
        sequences, attention, actions = _rows(rank)
        with torch.no_grad():
            scored = reference(sequences, actions, attention)
        torch.testing.assert_close(results[rank]["scored"], scored, atol=1e-5, rtol=0)
        reference.zero_grad(set_to_none=True)
        log_probs, loss = _loss(
            reference, sequences, attention, actions, scored + 0.05 * actions, _advantages(actions, rank)
        )
        loss.backward()
        torch.testing.assert_close(results[rank]["log_probs"], log_probs.detach(), atol=1e-5, rtol=0)
        grads.append({name: p.grad.clone() for name, p in reference.model.named_parameters()})
        assert results[rank]["checks"] == [True, True]
        assert list(results[rank]["fallbacks"].values()) == [1]
    for name in grads[0]:
        expected = (grads[0][name] + grads[1][name]) / 2  # ZeRO averages over data-parallel ranks
        got = results[0]["grads"][name]
        assert torch.equal(got, results[1]["grads"][name])
        error = (got - expected).norm() / expected.norm()
        assert error < 1e-4, f"{name}: relative gradient error {error:.2e}"
