"""Two-process gloo DDP: the shared path through DistributedDataParallel gives the dense path's averaged gradients."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.distributed import free_port, init_gloo, spawn_ranks
from support.tiny_models import build_model, make_batch

from shared_prefix_logps import chunked_backward, compute_logps


def _weights(rows, length):
    return torch.randn(rows, length, generator=torch.Generator().manual_seed(3))


def _loss(out, rows=None):
    weights = _weights(6, out.logps.shape[1])
    return (out.logps * (weights if rows is None else weights[rows])).sum()


def _worker(rank, port, results, find_unused):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    model = build_model("qwen2")
    # transformers' Trainer wraps with find_unused_parameters=True, which walks the graph from the outputs.
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=find_unused)
    prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=9, completion_len=5, seed=rank)
    out = compute_logps(ddp, prompts, comps, prompt_mask=pmask, completion_mask=cmask, temperature=0.8)
    _loss(out).backward()
    results[f"shared{rank}"] = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with ddp.no_sync():  # chunk backwards accumulate locally; the final one would sync in a real step
        chunked_backward(
            ddp,
            prompts,
            comps,
            _loss,
            generations_per_chunk=1,
            prompt_mask=pmask,
            completion_mask=cmask,
            temperature=0.8,
        )
    results[f"chunked{rank}"] = [p.grad.clone() for p in model.parameters()]
    dist.destroy_process_group()


@pytest.mark.parametrize("find_unused", [False, True])
def test_ddp_gradients_equal_averaged_dense_gradients(find_unused):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(free_port(), results, find_unused), nprocs=2, join=True)
    reference = build_model("qwen2")
    dense_grads = []
    for rank in range(2):
        reference.zero_grad()
        prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=9, completion_len=5, seed=rank)
        out = compute_logps(
            reference, prompts, comps, prompt_mask=pmask, completion_mask=cmask, temperature=0.8, backend="dense"
        )
        _loss(out).backward()
        dense_grads.append([p.grad.clone() for p in reference.parameters()])
    for i, _ in enumerate(reference.parameters()):
        averaged = (dense_grads[0][i] + dense_grads[1][i]) / 2
        for rank in range(2):
            # DDP all-reduces (averages) the shared path's gradients across the two ranks.
            assert (results[f"shared{rank}"][i] - averaged).norm() <= 1e-4 * averaged.norm() + 1e-10
            # Under no_sync each rank keeps its own gradient, equal to its own dense gradient.
            local = dense_grads[rank][i]
            assert (results[f"chunked{rank}"][i] - local).norm() <= 1e-4 * local.norm() + 1e-10


def _chunked_call(model, batch, generations_per_chunk=1):
    prompts, pmask, comps, cmask = batch
    return chunked_backward(
        model,
        prompts,
        comps,
        _loss,
        generations_per_chunk=generations_per_chunk,
        prompt_mask=pmask,
        completion_mask=cmask,
        temperature=0.8,
    )


def _sync_worker(rank, port, results, wrapping, accumulate):
    init_gloo(rank, port)
    try:
        model = build_model("qwen2")
        ddp = torch.nn.parallel.DistributedDataParallel(model, **wrapping)
        batches = [make_batch(2, 3, prompt_len=9, completion_len=5, seed=rank + 2 * step) for step in range(2)]
        if ddp.static_graph:  # refused before any forward, so the ranks stay in step
            with pytest.raises(ValueError, match="static_graph=False") as refusal:
                _chunked_call(ddp, batches[1])
            results[rank] = str(refusal.value)
            return
        if accumulate:
            with ddp.no_sync():  # gradient accumulation: the first micro-batch stays local
                _chunked_call(ddp, batches[0])
        # The synchronizing call: afterwards every rank holds the ranks' average of the accumulated gradient.
        _chunked_call(ddp, batches[1], generations_per_chunk=2)
        results[rank] = [p.grad.clone() for p in model.parameters()]
        dist.barrier()
    finally:
        dist.destroy_process_group()


WRAPPINGS = {
    "default": {},
    "find-unused": {"find_unused_parameters": True},
    "static-graph": {"static_graph": True},
}


@pytest.mark.parametrize("accumulate", [False, True], ids=["one-call", "no_sync-then-sync"])
@pytest.mark.parametrize("wrapping", list(WRAPPINGS))
def test_chunked_backward_synchronizing_call_averages_over_ranks(wrapping, accumulate):
    results = mp.Manager().dict()
    spawn_ranks(_sync_worker, (free_port(), results, WRAPPINGS[wrapping], accumulate))
    if wrapping == "static-graph":  # DDP's static-graph reducer allows one backward per forward: refused
        assert all("static_graph=True" in results[rank] for rank in range(2))
        return
    reference = build_model("qwen2")
    steps = (0, 1) if accumulate else (1,)
    for rank in range(2):
        for step in steps:
            prompts, pmask, comps, cmask = make_batch(2, 3, prompt_len=9, completion_len=5, seed=rank + 2 * step)
            out = compute_logps(
                reference, prompts, comps, prompt_mask=pmask, completion_mask=cmask, temperature=0.8, backend="dense"
            )
            _loss(out).backward()
    worst = 0.0
    for i, param in enumerate(reference.parameters()):
        averaged = param.grad / 2  # the sum over ranks (and micro-batches) of the dense gradients, averaged over ranks
        for rank in range(2):
            worst = max(worst, ((results[rank][i] - averaged).norm() / averaged.norm()).item())
    # Both ranks hold the averaged dense gradient (so their replicas stay equal after the optimizer step).
    print(f"largest relative gradient error {worst:.2g}")
    assert worst <= 1e-5, f"largest relative gradient error {worst:.3g}"
