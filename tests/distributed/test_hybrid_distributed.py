"""Two-process gloo DDP and FSDP2 on linear-attention hybrids: the recurrent layers' end states leave each node call
through module outputs (the wrappers see their gradient, FSDP2 unshards the units they come from for backward), as
the attention layers' keys/values do.

Every call goes through the wrapped model: no-grad ``compute_logps_concatenated``, grad-enabled ``compute_logps`` and
``chunked_backward`` (one generation per chunk: the prompts' states collect three chunks' gradients before their
node call back-propagates). Log-probs are compared with the single-process dense path on each rank's batch, every
parameter's full gradient with the average of the two ranks' dense gradients (what DDP's all-reduce and FSDP's
reduce-scatter compute).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from packaging.version import Version
from support.distributed import free_port, full_gradients, init_gloo, spawn_ranks, wrap_fsdp2
from support.hybrid_models import build_hybrid, hybrid_batch

from shared_prefix_logps import chunked_backward, compute_logps, compute_logps_concatenated
from shared_prefix_logps.recurrent.families import MIN_TRANSFORMERS

pytestmark = pytest.mark.skipif(
    Version(transformers.__version__) < MIN_TRANSFORMERS, reason=f"hybrids need transformers >= {MIN_TRANSFORMERS}"
)

GENERATIONS = 2


def _loss(out, rows=None):
    weights = torch.randn((3 * GENERATIONS, out.logps.shape[1]), generator=torch.Generator().manual_seed(7))
    weights = weights if rows is None else weights[rows]
    return (out.logps * weights).sum() + (out.entropy * weights.flip(1)).sum()


def _wrap(engine: str, model):
    if engine == "ddp":
        # transformers' Trainer wraps with find_unused_parameters=True, which walks the graph from the outputs.
        return torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    return wrap_fsdp2(model)


def _worker(rank, port, results, engine, family):
    init_gloo(rank, port, timeout_s=120)
    try:
        model = build_hybrid(family)
        names = [name for name, param in model.named_parameters() if param.requires_grad]
        wrapped = _wrap(engine, model)
        prompts, pmask, comps, cmask = hybrid_batch(GENERATIONS, seed=rank)
        kwargs = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
        with torch.no_grad():
            ids = torch.cat([prompts.repeat_interleave(GENERATIONS, 0), comps], 1)
            mask = torch.cat([pmask.repeat_interleave(GENERATIONS, 0), cmask], 1)
            scored = compute_logps_concatenated(wrapped, ids, mask, comps.shape[1])
        out = compute_logps(wrapped, prompts, comps, **kwargs)
        _loss(out).backward()
        grads = full_gradients(engine, wrapped, names)
        wrapped.zero_grad(set_to_none=True)
        chunked = chunked_backward(wrapped, prompts, comps, _loss, generations_per_chunk=1, **kwargs)
        results[rank] = dict(
            scored=scored.logps,
            logps=out.logps.detach(),
            chunked=chunked.logps,
            grads=grads,
            chunked_grads=full_gradients(engine, wrapped, names),
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("engine, family", [("ddp", "qwen3_next"), ("fsdp2", "qwen3_5_text")])
def test_wrapped_hybrids_match_dense(engine, family):
    results = mp.Manager().dict()
    spawn_ranks(_worker, (free_port(), results, engine, family))
    model = build_hybrid(family)
    dense_logps, dense_grads = [], []
    for rank in range(2):
        model.zero_grad(set_to_none=True)
        prompts, pmask, comps, cmask = hybrid_batch(GENERATIONS, seed=rank)
        out = compute_logps(
            model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True, backend="dense"
        )
        _loss(out).backward()
        dense_logps.append(out.logps.detach())
        dense_grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    averaged = {name: (dense_grads[0][name] + dense_grads[1][name]) / 2 for name in dense_grads[0]}
    for rank in range(2):
        got = results[rank]
        for key in ("scored", "logps", "chunked"):
            assert (got[key] - dense_logps[rank]).abs().max() <= 1e-5, (rank, key)
        for key in ("grads", "chunked_grads"):
            for name, reference in averaged.items():
                grad = got[key][name]
                assert grad is not None, (rank, key, name)
                assert (grad - reference).norm() <= 1e-4 * reference.norm() + 1e-10, (rank, key, name)
