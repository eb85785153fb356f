"""Two-process gloo runs where the processes see different rows, so that the shared path's own calls would differ in
number (no prompts' node call for one-token prompts, no forward for an all-masked batch, a smaller token budget,
fewer or skipped chunks): every core entry point keeps the processes' model calls in step itself
(``shared_prefix_logps/distributed/lockstep.py``). Under DDP (its buffers are broadcast in the forward after a
synchronizing one) and FSDP2 (every forward gathers, every backward reduce-scatters) the runs finish within their
timeout, log-probs equal the dense path's on each rank's rows, and every parameter's full gradient equals the ranks'
averaged dense gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.distributed import (
    free_port,
    full_gradients,
    init_deepspeed_gloo,
    init_gloo,
    set_rank_environment,
    spawn_ranks,
    wrap_fsdp1,
    wrap_fsdp2,
)
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import chunked_backward, compute_logps

COMPLETION_LEN = 5


def _loss(out, rows=None):
    """Log-probs and entropies weighted per row and position (the same weights on every rank)."""
    weights = torch.randn((6, COMPLETION_LEN), generator=torch.Generator().manual_seed(5))
    weights = weights[: out.logps.shape[0]] if rows is None else weights[rows]
    return (out.logps * weights).sum() + (out.entropy * weights.flip(1)).sum()


def _masked_generation(batch, generations: int, index: int):
    """``batch`` with generation ``index`` of every prompt fully masked (its chunk has no valid token)."""
    prompts, pmask, comps, cmask = batch
    cmask = cmask.clone()
    cmask[index::generations] = False
    return prompts, pmask, comps.masked_fill(~cmask, 0), cmask


def _calls(scenario: str, rank: int) -> list[tuple[str, tuple, dict]]:
    """The calls each rank makes: (kind, batch, options); kind ``grad`` (compute_logps and backward), ``score``
    (no-grad compute_logps) or ``chunked`` (chunked_backward)."""
    batch = make_batch(2, 3, prompt_len=9, completion_len=COMPLETION_LEN, seed=rank)
    if scenario == "one-token-prompts":  # rank 1: every prompt one token, so no prompts' node call
        if rank == 1:
            batch = make_batch(2, 3, prompt_len=1, completion_len=COMPLETION_LEN, seed=rank)
        return [("grad", batch, {}), ("chunked", batch, {})]
    if scenario == "masked-scoring":  # after a step: rank 1's scoring batch all masked, rank 0's in small batches
        prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=9, completion_len=COMPLETION_LEN, seed=2 + rank)
        if rank == 1:
            cmask = torch.zeros_like(cmask)
        scoring = (prompts, pmask, comps.masked_fill(~cmask, 0), cmask)
        return [
            ("grad", batch, {}),
            ("score", scoring, {"token_budget": 16 if rank == 0 else None}),
            ("grad", batch, {}),
        ]
    if scenario == "uneven-chunks":  # rank 1: G=2 (one chunk fewer) and its second generation all masked
        if rank == 1:
            batch = _masked_generation(make_batch(2, 2, prompt_len=9, completion_len=COMPLETION_LEN, seed=rank), 2, 1)
        return [("chunked", batch, {})]
    raise ValueError(scenario)


def _call(kind, model, batch, options, backward=torch.Tensor.backward):
    prompts, pmask, comps, cmask = batch
    common = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
    if kind == "score":
        with torch.no_grad():
            return compute_logps(model, prompts, comps, **common, **options)
    if kind == "chunked":
        return chunked_backward(model, prompts, comps, _loss, generations_per_chunk=1, **common, **options)
    out = compute_logps(model, prompts, comps, **common, **options)
    backward(_loss(out))
    return out


def _worker(rank, port, results, engine, scenario):
    init_gloo(rank, port, timeout_s=60)
    try:
        model = build_model("llama", tied=False)
        names = [name for name, _ in model.named_parameters()]
        if engine == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            wrapped = {"fsdp2": wrap_fsdp2, "fsdp1": wrap_fsdp1}[engine](model)
        record = []
        for kind, batch, options in _calls(scenario, rank):
            out = _call(kind, wrapped, batch, options)
            grads = None if kind == "score" else full_gradients(engine, wrapped, names)
            wrapped.zero_grad(set_to_none=True)
            record.append((out.logps.detach().clone(), grads))
        results[rank] = record
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _zero3_worker(rank, port, results, scenario):

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    set_rank_environment(rank, port)
    torch.set_num_threads(1)
    init_deepspeed_gloo(timeout_s=60)
    try:
        model = build_model("llama", tied=False)
        names = [name for name, _ in model.named_parameters()]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            # Every parameter partitioned (the tiny model's would all stay whole under the default threshold):
            # each submodule's forward gathers.
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        params = dict(engine.module.named_parameters())
        record = []
        for kind, batch, options in _calls(scenario, rank):
            out = _call(kind, engine, batch, options, backward=engine.backward)
            grads = None
            if kind != "score":  # a collective per parameter, the same names in the same order on every rank
                grads = {name: safe_get_full_grad(params[name]).detach().clone() for name in names}
                engine.step()  # lr 0: parameters unchanged; gradients cleared
            record.append((out.logps.detach().clone(), grads))
        results[rank] = record
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _dense_reference(scenario):
    model = build_model("llama", tied=False)
    per_rank = []
    for rank in range(2):
        record = []
        for kind, batch, _ in _calls(scenario, rank):
            model.zero_grad(set_to_none=True)
            prompts, pmask, comps, cmask = batch
            with torch.no_grad() if kind == "score" else torch.enable_grad():
                out = compute_logps(
                    model,
                    prompts,
                    comps,
                    prompt_mask=pmask,
                    completion_mask=cmask,
                    return_entropy=True,
                    backend="dense",
                )
            if kind != "score":
                _loss(out).backward()
            grads = None if kind == "score" else {n: p.grad.clone() for n, p in model.named_parameters()}
            record.append((out.logps.detach(), grads))
        per_rank.append(record)
    return per_rank


SCENARIOS = ["one-token-prompts", "masked-scoring", "uneven-chunks"]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "fsdp1"])
def test_processes_with_different_rows_stay_in_step(engine, scenario):
    results = mp.Manager().dict()
    spawn_ranks(_worker, (free_port(), results, engine, scenario), timeout_s=240)
    _check_against_dense(results, scenario)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_zero3_processes_with_different_rows_stay_in_step(monkeypatch, scenario):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, with gloo, also where a GPU is
    results = mp.Manager().dict()
    spawn_ranks(_zero3_worker, (free_port(), results, scenario), timeout_s=300)
    _check_against_dense(results, scenario)


def _check_against_dense(results, scenario):
    dense = _dense_reference(scenario)
    worst_logp, worst_grad = 0.0, 0.0
    for step, (_, reference_grads) in enumerate(dense[0]):
        for rank in range(2):
            logps, grads = results[rank][step]
            worst_logp = max(worst_logp, (logps - dense[rank][step][0]).abs().max().item())
            if reference_grads is None:
                continue
            for name, grad in grads.items():
                averaged = (dense[0][step][1][name] + dense[1][step][1][name]) / 2
                assert grad is not None, (rank, step, name)
                worst_grad = max(worst_grad, ((grad - averaged).norm() / averaged.norm()).item())
    print(f"largest log-prob error {worst_logp:.2g}, relative gradient error {worst_grad:.2g}")
    assert worst_logp <= 1e-5, f"largest log-prob error {worst_logp:.3g}"
    assert worst_grad <= 1e-4, f"largest relative gradient error {worst_grad:.3g}"


def test_lockstep_argument_is_checked():
    model = build_model("llama", tied=False)
    prompts, pmask, comps, cmask = make_batch(2, 2, prompt_len=4, completion_len=3)
    options = dict(prompt_mask=pmask, completion_mask=cmask)
    with pytest.raises(TypeError, match="lockstep must be True, False or None"):
        compute_logps(model, prompts, comps, **options, lockstep="yes")
    # Asked for explicitly, the agreement needs a process group; without one there is nothing to agree with.
    with pytest.raises(ValueError, match="lockstep=True needs an initialized torch.distributed process group"):
        chunked_backward(model, prompts, comps, _loss, generations_per_chunk=1, **options, lockstep=True)
    # Without a process group the default keeps no step and changes nothing: same numbers as the opt-out.
    default = compute_logps(model, prompts, comps, **options).logps
    assert torch.equal(default, compute_logps(model, prompts, comps, **options, lockstep=False).logps)
