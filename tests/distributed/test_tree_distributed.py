"""Two-process gloo DDP and FSDP2: ``chunked_backward_tree`` and ``compute_logps_tree`` through the wrapped model give
the dense path's gradients (local ones under DDP's ``no_sync``, the two ranks' average under FSDP2).

Each rank has its own rows, of the same trie shape: a system prompt, two prompts below it, completions below those,
one row a prefix of another. (Tries of different shapes, FSDP1 and ZeRO-3: test_tree_lockstep.py.)
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.distributed import free_port
from support.tiny_models import build_model
from support.trees import pad_alternating

from shared_prefix_logps import chunked_backward_tree, compute_logps_tree


def _rows(rank: int):
    """(ids, mask, score), 5 rows; tokens of every node distinct (no accidental sharing changes the trie's shape)."""
    base = 1 + 40 * rank
    system = list(range(base, base + 5))
    prompts = [[base + 10, base + 11], [base + 12, base + 13, base + 14]]
    rows = [
        system + prompts[0] + [base + 20, base + 21],
        system + prompts[0] + [base + 22],
        system + prompts[1] + [base + 23, base + 24, base + 25],
        system + prompts[1] + [base + 23],  # a prefix of the row above
        system + prompts[1] + [base + 26, base + 27],
    ]
    return pad_alternating(rows)


def _loss(out, rows=None):
    weights = torch.randn(5, out.logps.shape[1], generator=torch.Generator().manual_seed(3))
    weights = weights if rows is None else weights[rows]
    return (out.logps * weights).sum() + (out.entropy * weights.flip(1)).sum()


def _wrap_fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (2,))
    options = dict(mesh=mesh, reshard_after_forward=True, mp_policy=MixedPrecisionPolicy(cast_forward_inputs=True))
    for layer in model.model.layers:
        fully_shard(layer, **options)
    fully_shard(model.model.embed_tokens, **options)
    fully_shard(model.lm_head, **options)
    fully_shard(model, **options)
    return model


def _full(grad):
    if grad is None:
        return None
    return (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()


def _worker(rank, port, results, engine):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        model = build_model("llama", tied=False)
        ids, mask, score = _rows(rank)
        if engine == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
            with wrapped.no_sync():  # chunk and node backwards accumulate locally
                out = chunked_backward_tree(wrapped, ids, mask, score, _loss, rows_per_chunk=2, return_entropy=True)
            results[rank] = dict(logps=out.logps, grads={n: _full(p.grad) for n, p in model.named_parameters()})
        elif engine == "ddp_sync":  # the synchronizing call: every rank ends with the ranks' average
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
            out = chunked_backward_tree(wrapped, ids, mask, score, _loss, rows_per_chunk=2, return_entropy=True)
            results[rank] = dict(logps=out.logps, chunked_grads={n: _full(p.grad) for n, p in model.named_parameters()})
        else:
            wrapped = _wrap_fsdp2(model)
            out = compute_logps_tree(wrapped, ids, mask, score, return_entropy=True)
            _loss(out).backward()
            grads = {n: _full(p.grad) for n, p in wrapped.named_parameters()}
            wrapped.zero_grad(set_to_none=True)
            chunked = chunked_backward_tree(wrapped, ids, mask, score, _loss, rows_per_chunk=1, return_entropy=True)
            results[rank] = dict(
                logps=out.logps.detach(),
                chunked_logps=chunked.logps,
                grads=grads,
                chunked_grads={n: _full(p.grad) for n, p in wrapped.named_parameters()},
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _dense(rank):
    model = build_model("llama", tied=False)
    out = compute_logps_tree(model, *_rows(rank), return_entropy=True, backend="dense")
    _loss(out).backward()
    return out.logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _close(grad, reference):
    assert grad is not None
    return (grad - reference).norm().item() <= 1e-4 * reference.norm().item() + 1e-8


@pytest.mark.parametrize("engine", ["ddp", "ddp_sync", "fsdp2"])
def test_tree_through_wrapped_models_matches_dense(engine):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(free_port(), results, engine), nprocs=2, join=True)
    dense = [_dense(rank) for rank in range(2)]
    averaged = {name: (dense[0][1][name] + dense[1][1][name]) / 2 for name in dense[0][1]}
    for rank in range(2):
        got = results[rank]
        logps, grads = dense[rank]
        for key in ("logps", "chunked_logps"):
            if key in got:
                assert (got[key] - logps).abs().max() <= 1e-5, (rank, key)
        if engine == "ddp":
            for name, reference in grads.items():  # under no_sync each rank keeps its own gradient
                assert _close(got["grads"][name], reference), (rank, name)
        else:
            for key in ("grads", "chunked_grads"):  # FSDP and DDP's synchronizing call give the ranks' average
                for name, reference in averaged.items() if key in got else ():
                    assert _close(got[key][name], reference), (rank, key, name)
