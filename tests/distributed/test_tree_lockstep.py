"""Two-process gloo runs of the tree entry points under FSDP1, FSDP2, DDP and DeepSpeed ZeRO-3, where the processes'
tries have the same shape or differ (other rows, other numbers of rows, other trie depths, another token budget):
every run finishes within its timeout (the tree entry points keep the processes' model calls in step,
``shared_prefix_logps/tree/lockstep.py``), log-probs equal the dense path's on each rank's rows, and every
parameter's full gradient equals the ranks' averaged dense gradient.

Each rank makes, through the wrapped model: a no-grad ``compute_logps_tree``, a grad-enabled one followed by the
backward of its loss (not under DDP, whose synchronizing backward expects one forward), and ``chunked_backward_tree``
(a synchronizing call under DDP; under ZeRO-3 through the engine, after checking that the engine's own module is
refused).
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
from support.tiny_models import build_model
from support.trees import pad_alternating

from shared_prefix_logps import chunked_backward_tree, compute_logps_tree
from shared_prefix_logps.engine.merge import MERGE_BELOW_SAVED_TOKENS, rows_trie
from shared_prefix_logps.engine.trie import levels
from shared_prefix_logps.inputs import check_tree_rows


def _rows(rank: int, scenario: str):
    """Each rank's rows. ``same``: the same trie shape on both ranks (a system prompt, two prompts, completions, a
    row that is a prefix of another: 4 depths unmerged). ``different`` and ``merged``: rank 1 has 3 rows of 2 depths
    instead."""
    base = 1 + 40 * rank
    system = list(range(base, base + 5))
    prompts = [[base + 10, base + 11], [base + 12, base + 13, base + 14]]
    if scenario in ("different", "merged") and rank == 1:
        return pad_alternating(
            [system + [base + 20, base + 21], system + [base + 22], [base + 30, base + 31, base + 32]]
        )
    return pad_alternating(
        [
            system + prompts[0] + [base + 20, base + 21],
            system + prompts[0] + [base + 22],
            system + prompts[1] + [base + 23, base + 24, base + 25],
            system + prompts[1] + [base + 23],
            system + prompts[1] + [base + 26, base + 27],
        ]
    )


def _weights(shape):
    gen = torch.Generator().manual_seed(3)
    return torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def _loss_fn(shape):
    """``loss(out, rows=None)``: log-probs and entropies weighted per row and position (rows: a chunk's)."""
    w_logps, w_entropy = _weights(shape)

    def loss(out, rows=None):
        a, b = (w_logps, w_entropy) if rows is None else (w_logps[rows], w_entropy[rows])
        return (out.logps * a).sum() + (out.entropy * b).sum()

    return loss


def _options(scenario: str) -> dict:
    """Unmerged, so that each rank's trie depths are what the rows say, but in ``merged`` (the ``different`` rows with
    the tiny-node rule, which flattens them to 2 depths on rank 0 and 1 on rank 1)."""
    return dict(return_entropy=True, merge_tiny_nodes=scenario == "merged")


def _worker(rank, port, results, engine, scenario):
    init_gloo(rank, port, timeout_s=60)
    try:
        model = build_model("llama", tied=False)
        names = [name for name, _ in model.named_parameters()]
        ids, mask, score = _rows(rank, scenario)
        loss, options = _loss_fn(ids.shape), _options(scenario)
        if engine == "ddp":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        else:
            wrapped = {"fsdp2": wrap_fsdp2, "fsdp1": wrap_fsdp1}[engine](model)
        record = {}
        with torch.no_grad():  # rank 0 in chunks of a small token budget: more forwards than rank 1's
            budget = 8 if rank == 0 else None
            record["scored"] = compute_logps_tree(wrapped, ids, mask, score, token_budget=budget, **options).logps
        if engine != "ddp":
            out = compute_logps_tree(wrapped, ids, mask, score, **options)
            loss(out).backward()
            record["logps"] = out.logps.detach()
            record["grads"] = full_gradients(engine, wrapped, names)
            wrapped.zero_grad(set_to_none=True)
        out = chunked_backward_tree(wrapped, ids, mask, score, loss, rows_per_chunk=1, **options)
        record["chunked"] = out.logps
        record["chunked_grads"] = full_gradients(engine, wrapped, names)
        results[rank] = record
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _zero3_worker(rank, port, results, scenario, accumulation):

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
            "gradient_accumulation_steps": accumulation,
            # Every parameter partitioned, so that each submodule's forward gathers.
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        params = dict(engine.module.named_parameters())
        ids, mask, score = _rows(rank, scenario)
        loss, options = _loss_fn(ids.shape), _options(scenario)
        record = {}
        with torch.no_grad():
            budget = 8 if rank == 0 else None
            record["scored"] = compute_logps_tree(engine, ids, mask, score, token_budget=budget, **options).logps
        full_grads = lambda: {name: safe_get_full_grad(params[name]).detach().clone() for name in names}  # noqa: E731
        # Each micro-batch the same rows: at the boundary ZeRO's mean over micro-batches and ranks is the ranks' mean.
        for _ in range(accumulation):
            out = compute_logps_tree(engine, ids, mask, score, **options)
            engine.backward(loss(out))
            record["logps"], record["grads"] = out.logps.detach(), full_grads()
            engine.step()  # lr 0: parameters unchanged; gradients cleared at the boundary
        # The engine's own module would take backward passes that ZeRO cannot accumulate.
        with pytest.raises(ValueError, match="pass the engine itself"):
            chunked_backward_tree(engine.module, ids, mask, score, loss, **options)
        for _ in range(accumulation):
            out = chunked_backward_tree(engine, ids, mask, score, loss, rows_per_chunk=1, **options)
            record["chunked"], record["chunked_grads"] = out.logps, full_grads()
            engine.step()
        results[rank] = record
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _dense(scenario):
    """Per rank (log-probs, gradient) of the dense path on that rank's rows."""
    model = build_model("llama", tied=False)
    per_rank = []
    for rank in range(2):
        model.zero_grad(set_to_none=True)
        ids, mask, score = _rows(rank, scenario)
        out = compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
        _loss_fn(ids.shape)(out).backward()
        per_rank.append((out.logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    return per_rank


def _check(results, scenario):
    dense = _dense(scenario)
    averaged = {name: (dense[0][1][name] + dense[1][1][name]) / 2 for name in dense[0][1]}
    worst_logp, worst_grad = 0.0, 0.0
    for rank in range(2):
        got = results[rank]
        for key in ("scored", "logps", "chunked"):
            if key in got:
                worst_logp = max(worst_logp, (got[key] - dense[rank][0]).abs().max().item())
        for key in ("grads", "chunked_grads"):
            for name, reference in averaged.items() if key in got else ():
                grad = got[key][name]
                assert grad is not None, (rank, key, name)
                worst_grad = max(worst_grad, ((grad - reference).norm() / reference.norm()).item())
    print(f"largest log-prob error {worst_logp:.2g}, relative gradient error {worst_grad:.2g}")
    assert worst_logp <= 1e-5, worst_logp
    assert worst_grad <= 1e-4, worst_grad


def test_the_scenarios_differ_in_trie_depth():
    model = build_model("llama", tied=False)
    from shared_prefix_logps.model import prepare_model

    prepared = prepare_model(model)
    depths = {}
    for scenario in ("same", "different"):
        for rank in range(2):
            rows = check_tree_rows(*_rows(rank, scenario), model=prepared)
            depths[scenario, rank] = len(levels(rows_trie(rows, 0)))
            depths["merged", rank] = len(levels(rows_trie(rows, MERGE_BELOW_SAVED_TOKENS)))
    assert depths["same", 0] == depths["same", 1] == 4
    assert depths["different", 0] == 4 and depths["different", 1] == 2
    assert depths["merged", 0] == 2 and depths["merged", 1] == 1


@pytest.mark.parametrize(
    "engine, scenario",
    [("fsdp1", "same"), ("fsdp1", "different"), ("fsdp2", "different"), ("fsdp2", "merged"), ("ddp", "different")],
)
def test_tree_entry_points_stay_in_step_and_exact(engine, scenario):
    results = mp.Manager().dict()
    spawn_ranks(_worker, (free_port(), results, engine, scenario), timeout_s=240)
    _check(results, scenario)


@pytest.mark.slow
@pytest.mark.parametrize("scenario, accumulation", [("same", 1), ("different", 1), ("different", 2)])
def test_zero3_tree_entry_points_stay_in_step_and_exact(monkeypatch, scenario, accumulation):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, with gloo, also where a GPU is
    results = mp.Manager().dict()
    spawn_ranks(_zero3_worker, (free_port(), results, scenario, accumulation), timeout_s=300)
    _check(results, scenario)


def test_lockstep_argument_is_checked():
    model = build_model("llama", tied=False)
    ids, mask, score = _rows(0, "same")
    loss = _loss_fn(ids.shape)
    with pytest.raises(TypeError, match="lockstep must be True, False or None"):
        compute_logps_tree(model, ids, mask, score, lockstep="yes")
    with pytest.raises(ValueError, match="lockstep=True needs an initialized torch.distributed process group"):
        chunked_backward_tree(model, ids, mask, score, loss, return_entropy=True, lockstep=True)
