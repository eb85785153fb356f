"""Two-process gloo runs over pairs of shapes, one per process, drawn at random (seeded) among the shapes whose model
calls differ in number: an empty process, one row, duplicates of one row, flat, chained and deep tries, a deepest node
without a scored token, different G and ``generations_per_chunk``, prompts sharing a system prompt (the automatic trie
pass) on one process or both, one-token prompts, all completions masked, a first chunk without a valid token (its loss
a constant without grad, or not). Every process runs each entry point on its shape of the pair:

- tree shapes: ``compute_logps_tree`` without gradients (its own token budget), with gradients and the backward of
  its loss, and ``chunked_backward_tree`` (its own ``rows_per_chunk``, its own tiny-node rule);
- grouped shapes: ``compute_logps`` without gradients, with gradients and the backward of its loss, and
  ``chunked_backward`` (its own G and ``generations_per_chunk``).

Under DDP and FSDP2 every run ends within its timeout, the processes make the same number of model forwards in every
call (counted on the model), log-probs equal the dense path's on each process's rows, and every parameter's full
gradient equals the processes' averaged dense gradient. Under FSDP1 and DeepSpeed ZeRO-3 the same holds for the
first pairs.

The first pairs are the shapes that hung or aborted before (an empty process beside a trie of one node in grad-enabled
scoring; a trie of three depths beside one of two whose deeper call has no scored pair; ``chunked_backward`` with a
shared system prompt and different numbers of chunks, or the system prompt on one process only, or a first chunk
without a valid token whose loss is skipped); the rest are drawn from the seed. ``SPL_SHAPE_PAIRS_SEED`` and
``SPL_SHAPE_PAIRS`` (random pairs per engine) change the draw, to explore more.
"""

from __future__ import annotations

import os
import random

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
from support.tiny_models import VOCAB, build_model
from support.trees import pad_rows, random_tree_rows, spy_searched_plans

from shared_prefix_logps import chunked_backward, chunked_backward_tree, compute_logps, compute_logps_tree

SEED = int(os.environ.get("SPL_SHAPE_PAIRS_SEED", "35"))
RANDOM_PAIRS = int(os.environ.get("SPL_SHAPE_PAIRS", "6"))

TREE_KINDS = ("empty", "one_row", "duplicates", "flat", "chain", "unscored_leaf", "deep")
GROUPED_KINDS = ("plain", "system", "one_token", "masked")
#: Prompt tokens shared by the prompts of a ``system`` shape: enough for the automatic trie pass
#: (``engine/sharing.py``: at least 64 tokens and a fifth of what the two-level trie forwards).
SYSTEM_TOKENS = 70


def _tree_shape(kind: str, rng: random.Random) -> dict:
    rows = rng.randint(1, 3)
    return dict(
        kind=kind,
        seed=rng.randrange(10**6),
        rows=rows,
        depth=rng.randint(2, 4),
        merge=rng.random() < 0.5,
        rows_per_chunk=rng.randint(1, 3),
        budget=rng.choice([None, 8, 24]),
    )


def _grouped_shape(kind: str, rng: random.Random) -> dict:
    generations = rng.randint(1, 4)
    return dict(
        kind=kind,
        seed=rng.randrange(10**6),
        prompts=rng.randint(2, 3) if kind == "system" else rng.randint(1, 3),
        generations=generations,
        per_chunk=rng.randint(1, generations),
        budget=rng.choice([None, 16]),
        mask_first=rng.random() < 0.25,
        skip_empty=rng.random() < 0.5,
    )


def _pairs(seed: int, count: int) -> list[tuple[str, dict, dict]]:
    """(entry, rank 0's shape, rank 1's shape): the shapes that once hung, then ``count`` pairs drawn from ``seed``."""
    rng = random.Random(seed)

    def tree(kind, **fixed):
        return {**_tree_shape(kind, rng), **fixed}

    def grouped(kind, **fixed):
        return {**_grouped_shape(kind, rng), **fixed}

    pairs = [
        # Grad-enabled scoring: an empty process beside a trie of one node (one row; duplicates of one row).
        ("tree", tree("empty"), tree("one_row", merge=True)),
        ("tree", tree("empty"), tree("duplicates", rows=3)),
        # Grad-enabled scoring: three depths beside two whose deeper call has no scored pair and no child.
        ("tree", tree("chain", merge=False), tree("unscored_leaf", merge=False)),
        # chunked_backward with a shared system prompt: different G; different generations_per_chunk.
        ("grouped", grouped("system", generations=2, per_chunk=1), grouped("system", generations=3, per_chunk=1)),
        ("grouped", grouped("system", generations=2, per_chunk=1), grouped("system", generations=2, per_chunk=2)),
        # The automatic trie pass on one process only.
        ("grouped", grouped("system", generations=3, per_chunk=1), grouped("plain")),
        # A shared system prompt whose first chunk has no valid token, its loss skipped (a constant without grad).
        (
            "grouped",
            grouped("system", generations=2, per_chunk=1, mask_first=True, skip_empty=True),
            grouped("system", generations=2, per_chunk=1, mask_first=False),
        ),
    ]
    for _ in range(count):
        if rng.random() < 0.5:
            pairs.append(("tree", tree(rng.choice(TREE_KINDS)), tree(rng.choice(TREE_KINDS))))
        else:
            pairs.append(("grouped", grouped(rng.choice(GROUPED_KINDS)), grouped(rng.choice(GROUPED_KINDS))))
    return pairs


#: The calls each pair makes, per entry, in order (``_calls``); the grad-enabled ones are compared on gradients too.
CALLS = {
    "tree": ("compute_logps_tree/no-grad", "compute_logps_tree", "chunked_backward_tree"),
    "grouped": ("compute_logps/no-grad", "compute_logps", "chunked_backward"),
}


def _tree_rows(shape: dict):
    """(ids, attention_mask, score_mask) of a tree shape."""
    gen = torch.Generator().manual_seed(shape["seed"])
    kind = shape["kind"]
    if kind == "empty":  # every row all padding: no trie node at all
        ids = torch.zeros(shape["rows"], 6, dtype=torch.long)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        return ids, mask, mask.clone()
    if kind == "chain":  # each row a prefix of the next: a chain of three nodes (three depths), every token scored
        row = torch.randint(0, VOCAB, (9,), generator=gen).tolist()
        return pad_rows([row[:3], row[:6], row], shape["seed"], hole_rate=0.0)
    if kind in ("one_row", "duplicates"):  # a trie of one node
        row = torch.randint(0, VOCAB, (int(torch.randint(2, 9, (1,), generator=gen)),), generator=gen).tolist()
        rows = [row] * (1 if kind == "one_row" else max(2, shape["rows"]))
    elif kind == "unscored_leaf":  # two depths; the deeper node's tokens unscored: its call has no scored pair
        row = torch.randint(0, VOCAB, (6,), generator=gen).tolist()
        ids, mask, score = pad_rows([row[:4], row], shape["seed"], hole_rate=0.0)
        score[1] &= mask[1].cumsum(0) <= 4  # the second row (right-padded) scored on its first 4 tokens only
        return ids, mask, score
    elif kind == "flat":  # rows that share nothing: one level, several nodes
        lengths = torch.randint(2, 8, (3,), generator=gen)
        rows = [torch.randint(0, VOCAB, (int(n),), generator=gen).tolist() for n in lengths]
    else:
        rows = random_tree_rows(shape["seed"], depth=shape["depth"], branching=2)
    return pad_rows(rows, shape["seed"])


def _grouped_batch(shape: dict):
    """(prompts, prompt_mask, completions, completion_mask) of a grouped shape, left-padded prompts and right-padded
    completions with one empty completion where there are enough rows."""
    gen = torch.Generator().manual_seed(shape["seed"])
    num, generations, kind = shape["prompts"], shape["generations"], shape["kind"]
    width = SYSTEM_TOKENS + 4 if kind == "system" else 6
    if kind == "one_token":  # no prompt node call
        lengths = torch.ones(num, dtype=torch.long)
    else:  # a system shape's prompts each have a token of their own after the system prompt
        lengths = torch.randint(SYSTEM_TOKENS + 1 if kind == "system" else 2, width + 1, (num,), generator=gen)
    prompts = torch.randint(0, VOCAB, (num, width), generator=gen)
    if kind == "system":
        system = torch.randint(0, VOCAB, (SYSTEM_TOKENS,), generator=gen)
        for i in range(num):
            start = width - int(lengths[i])
            prompts[i, start : start + SYSTEM_TOKENS] = system
    prompt_mask = torch.arange(width)[None, :] >= (width - lengths)[:, None]
    rows, completion_len = num * generations, 4
    comp_lengths = torch.randint(1, completion_len + 1, (rows,), generator=gen)
    if rows > 2:
        comp_lengths[1] = 0
    if kind == "masked":
        comp_lengths.zero_()
    if shape[
        "mask_first"
    ]:  # generation 0 of every prompt empty: with one generation per chunk, a chunk without a token
        comp_lengths[0::generations] = 0
    completions = torch.randint(0, VOCAB, (rows, completion_len), generator=gen)
    completion_mask = torch.arange(completion_len)[None, :] < comp_lengths[:, None]
    return (
        prompts.masked_fill(~prompt_mask, 0),
        prompt_mask,
        completions.masked_fill(~completion_mask, 0),
        completion_mask,
    )


def _loss_fn(shape: tuple, seed: int, skip_empty: bool = False):
    """``loss(out, rows=None)``: log-probs and entropies weighted per row and position (``rows``: a chunk's), so that
    a gradient routed to the wrong token or row shows. With ``skip_empty`` a chunk without a valid token gets a
    constant without grad (the chunked backwards then skip its backward; the sum of the losses is the same)."""
    gen = torch.Generator().manual_seed(seed)
    w_logps, w_entropy = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)

    def loss(out, rows=None):
        if skip_empty and rows is not None and not out.mask.any():
            return torch.zeros(())
        a, b = (w_logps, w_entropy) if rows is None else (w_logps[rows], w_entropy[rows])
        return (out.logps * a).sum() + (out.entropy * b).sum()

    return loss


def _calls(entry: str, shape: dict, backward=torch.Tensor.backward):
    """[run(model, dense) -> LogpsOutput] in the order of ``CALLS[entry]``: each makes its call (and its backward,
    through ``backward`` unless ``dense``) through ``model``, with ``dense=True`` the dense path's equivalent on an
    unwrapped model (the whole batch's loss in one backward, which is the sum of the chunks' losses)."""
    if entry == "tree":
        ids, mask, score = _tree_rows(shape)
        loss = _loss_fn(ids.shape, shape["seed"])
        merge = dict(return_entropy=True, merge_tiny_nodes=shape["merge"])

        def score_call(model, dense):
            with torch.no_grad():
                if dense:
                    return compute_logps_tree(model, ids, mask, score, return_entropy=True, backend="dense")
                return compute_logps_tree(model, ids, mask, score, token_budget=shape["budget"], **merge)

        def grad_call(model, dense):
            options = dict(return_entropy=True, backend="dense") if dense else merge
            out = compute_logps_tree(model, ids, mask, score, **options)
            (torch.Tensor.backward if dense else backward)(loss(out))
            return out

        def chunked_call(model, dense):
            if dense:
                return grad_call(model, True)
            return chunked_backward_tree(model, ids, mask, score, loss, rows_per_chunk=shape["rows_per_chunk"], **merge)

        return [score_call, grad_call, chunked_call]
    prompts, pmask, comps, cmask = _grouped_batch(shape)
    loss = _loss_fn(comps.shape, shape["seed"], shape["skip_empty"])
    common = dict(prompt_mask=pmask, completion_mask=cmask, return_entropy=True)

    def score_call(model, dense):
        with torch.no_grad():
            options = dict(backend="dense") if dense else dict(token_budget=shape["budget"])
            return compute_logps(model, prompts, comps, **common, **options)

    def grad_call(model, dense):
        out = compute_logps(model, prompts, comps, **common, **(dict(backend="dense") if dense else {}))
        (torch.Tensor.backward if dense else backward)(loss(out))
        return out

    def chunked_call(model, dense):
        if dense:
            return grad_call(model, True)
        return chunked_backward(model, prompts, comps, loss, generations_per_chunk=shape["per_chunk"], **common)

    return [score_call, grad_call, chunked_call]


def _wrap(engine: str, model, port: int, rank: int):
    """(wrapped model, its backward, its full gradients by name (a collective), clear its gradients) under ``engine``,
    after joining the two-process gloo group (a rank left waiting in a collective fails within 30 s)."""
    names = [name for name, _ in model.named_parameters()]
    if engine != "zero3":
        init_gloo(rank, port, timeout_s=30)
        wrapped = {"ddp": torch.nn.parallel.DistributedDataParallel, "fsdp1": wrap_fsdp1, "fsdp2": wrap_fsdp2}[engine](
            model
        )
        clear = lambda: wrapped.zero_grad(set_to_none=True)  # noqa: E731
        return wrapped, torch.Tensor.backward, lambda: full_gradients(engine, wrapped, names), clear

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    set_rank_environment(rank, port)
    torch.set_num_threads(1)
    init_deepspeed_gloo(timeout_s=30)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        # Every parameter partitioned, so that each submodule's forward gathers.
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapped, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    params = dict(wrapped.module.named_parameters())
    grads = lambda: {name: safe_get_full_grad(params[name]).detach().clone() for name in names}  # noqa: E731
    return wrapped, wrapped.backward, grads, wrapped.step  # lr 0: a step only clears the gradients


def _worker(rank, port, results, engine, pairs):
    try:
        model = build_model("llama", tied=False)
        reference = build_model("llama", tied=False)  # the same weights, unwrapped: the dense path's
        forwards, searched = [0], [0]
        model.register_forward_pre_hook(lambda module, args: forwards.__setitem__(0, forwards[0] + 1))
        wrapped, backward, full_grads, clear = _wrap(engine, model, port, rank)
        spy_searched_plans(lambda batch: searched.__setitem__(0, searched[0] + 1))
        record = []
        for entry, *shapes in pairs:
            for name, run in zip(CALLS[entry], _calls(entry, shapes[rank], backward)):
                forwards[0] = searched[0] = 0
                out = run(wrapped, False)
                made, deeper = forwards[0], searched[0] > 0
                logp_error = (out.logps.detach() - run(reference, True).logps.detach()).abs().max().item()
                grad_error, missing = 0.0, []
                if not name.endswith("no-grad"):
                    got = full_grads()
                    dense = {}
                    for param_name, param in reference.named_parameters():
                        dense[param_name] = param.grad.detach().clone()
                        dist.all_reduce(dense[param_name])  # the same parameters in the same order on both ranks
                        dense[param_name] /= 2  # the processes' averaged dense gradient
                    # Relative to the parameter's gradient, or to a thousandth of the whole gradient where the
                    # parameter's is smaller: some shapes give a parameter a gradient that is zero up to rounding
                    # (a query over a single key), whose relative error says nothing.
                    floor = 1e-3 * torch.stack([grad.norm() for grad in dense.values()]).norm().clamp(min=1e-3)
                    for param_name, reference_grad in dense.items():
                        if got[param_name] is None:
                            missing.append(param_name)
                            continue
                        error = (got[param_name] - reference_grad).norm() / torch.maximum(reference_grad.norm(), floor)
                        grad_error = max(grad_error, error.item())
                    clear()
                    reference.zero_grad(set_to_none=True)
                record.append(dict(forwards=made, deeper=deeper, logp=logp_error, grad=grad_error, missing=missing))
        results[rank] = record
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_and_check(engine: str, pairs, timeout_s: float) -> None:
    """Both ranks over ``pairs`` under ``engine`` within ``timeout_s``; every call exact, and as many forwards on
    each rank."""
    results = mp.Manager().dict()
    spawn_ranks(_worker, (free_port(), results, engine, pairs), timeout_s=timeout_s)
    calls = [(index, name) for index, (entry, *_) in enumerate(pairs) for name in CALLS[entry]]
    assert len(results[0]) == len(results[1]) == len(calls)
    worst_logp = worst_grad = 0.0
    deeper = {}
    for (index, name), mine, theirs in zip(calls, results[0], results[1]):
        where = f"{engine}: {name} on pair {index} {pairs[index]}"
        assert mine["forwards"] == theirs["forwards"], f"{where}: forwards {mine['forwards']} vs {theirs['forwards']}"
        for got in (mine, theirs):
            assert not got["missing"], f"{where}: no gradient for {got['missing']}"
            assert got["logp"] <= 1e-5, f"{where}: log-prob error {got['logp']:.3g}"
            assert got["grad"] <= 1e-4, f"{where}: relative gradient error {got['grad']:.3g}"
            worst_logp, worst_grad = max(worst_logp, got["logp"]), max(worst_grad, got["grad"])
        deeper[index, name] = (mine["deeper"], theirs["deeper"])
    print(
        f"{engine}, seed {SEED}: {len(pairs)} pairs, {len(calls)} calls; largest log-prob error {worst_logp:.2g}, "
        f"relative gradient error {worst_grad:.2g}"
    )
    # The regression pairs are what they say: chunked_backward took the system prompt's trie on both processes,
    # then on rank 0 only.
    assert (
        deeper[3, "chunked_backward"] == deeper[4, "chunked_backward"] == deeper[6, "chunked_backward"] == (True, True)
    )
    assert deeper[5, "chunked_backward"] == (True, False)


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_processes_with_any_pair_of_shapes_stay_in_step(engine):
    _run_and_check(engine, _pairs(SEED, RANDOM_PAIRS), timeout_s=240)


@pytest.mark.parametrize("engine", ["fsdp1", "zero3"])
def test_the_pairs_that_hung_stay_in_step_under_fsdp1_and_zero3(monkeypatch, engine):
    """The regression pairs only (a shorter run): FSDP1, and DeepSpeed ZeRO-3 on its CPU accelerator."""
    if engine == "zero3":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")
        monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, with gloo, also where a GPU is
    _run_and_check(engine, _pairs(SEED, 0), timeout_s=240)
