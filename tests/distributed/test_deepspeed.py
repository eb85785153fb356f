"""Two-process DeepSpeed ZeRO-2 and ZeRO-3 on DeepSpeed's CPU accelerator (gloo), fp32, models wrapped by
``deepspeed.initialize`` as trainers wrap them, with and without gradient accumulation.

Every call goes through the engine: no-grad ``compute_logps_concatenated``, grad-enabled ``compute_logps`` followed
by ``engine.backward(loss)``, and ``chunked_backward`` (which drives ``engine.backward`` itself), each micro-batch
followed by ``engine.step()``. Log-probs are compared with the single-process dense path on each rank's
micro-batch, and every parameter's full gradient at the accumulation boundary (``safe_get_full_grad``, before the
step) with the mean of the dense gradients over ranks and micro-batches (what ZeRO's reduction computes).
"""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
from support.distributed import (
    GENERATIONS,
    concatenated,
    free_port,
    init_deepspeed_gloo,
    set_rank_environment,
    weighted_loss,
)
from support.tiny_models import build_model, make_batch, randomize_lora

from shared_prefix_logps import chunked_backward, compute_logps, compute_logps_concatenated

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[deepspeed]')")


def _model(family: str, tied: bool, lora: bool):
    model = build_model(family, tied=tied)
    if lora:
        import peft

        targets = ["q_proj", "v_proj"] + ([] if tied else ["lm_head"])
        config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets, lora_dropout=0.0)
        model = randomize_lora(peft.get_peft_model(model, config))
    return model


def _batch(rank: int, micro_batch: int = 0):
    return make_batch(2, GENERATIONS, prompt_len=9, completion_len=5, seed=rank + 2 * micro_batch)


def _config(stage: int, accumulation: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": accumulation,
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
    }


def _full_grads(engine, names) -> dict:
    from deepspeed.utils import safe_get_full_grad

    params = dict(engine.module.named_parameters())
    result = {}
    for name in names:  # a collective per parameter: every rank walks the same names in the same order
        grad = safe_get_full_grad(params[name])
        result[name] = None if grad is None else grad.detach().clone().float()
    return result


def _worker(rank, port, results, stage, family, tied, lora, accumulation):
    set_rank_environment(rank, port)
    torch.set_num_threads(1)
    init_deepspeed_gloo()
    try:
        model = _model(family, tied, lora)
        names = [name for name, param in model.named_parameters() if param.requires_grad]
        optimizer = torch.optim.SGD([param for param in model.parameters() if param.requires_grad], lr=0.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=_config(stage, accumulation))
        batches = [_batch(rank, micro_batch) for micro_batch in range(accumulation)]
        prompts, pmask, comps, cmask = batches[0]
        # The engine's own module would take backward passes that ZeRO overwrites instead of accumulating.
        with pytest.raises(ValueError, match="pass the engine itself"):
            chunked_backward(engine.module, prompts, comps, weighted_loss, generations_per_chunk=1, prompt_mask=pmask)
        scored, logps, chunked = [], [], []
        for micro_batch, (prompts, pmask, comps, cmask) in enumerate(batches):
            with torch.no_grad():
                rows, mask = concatenated(prompts, pmask, comps, cmask)
                scored.append(compute_logps_concatenated(engine, rows, mask, comps.shape[1]).logps)
            out = compute_logps(engine, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True)
            engine.backward(weighted_loss(out))
            logps.append(out.logps.detach())
            if micro_batch == accumulation - 1:
                grads = _full_grads(engine, names)
            engine.step()  # lr 0: parameters unchanged; gradients cleared at the boundary
        for micro_batch, (prompts, pmask, comps, cmask) in enumerate(batches):
            out = chunked_backward(
                engine,
                prompts,
                comps,
                weighted_loss,
                generations_per_chunk=1,
                prompt_mask=pmask,
                completion_mask=cmask,
                return_entropy=True,
            )
            chunked.append(out.logps)
            if micro_batch == accumulation - 1:
                chunked_grads = _full_grads(engine, names)
            engine.step()
        results[rank] = dict(scored=scored, logps=logps, chunked=chunked, grads=grads, chunked_grads=chunked_grads)
        deepspeed.comm.barrier()
    finally:
        torch.distributed.destroy_process_group()


def _dense_reference(family, tied, lora, accumulation):
    model = _model(family, tied, lora)
    logps, grads = {}, []
    for rank in range(2):
        for micro_batch in range(accumulation):
            model.zero_grad(set_to_none=True)
            prompts, pmask, comps, cmask = _batch(rank, micro_batch)
            out = compute_logps(
                model, prompts, comps, prompt_mask=pmask, completion_mask=cmask, return_entropy=True, backend="dense"
            )
            weighted_loss(out).backward()
            logps[rank, micro_batch] = out.logps.detach()
            grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    averaged = {name: sum(grad[name] for grad in grads) / len(grads) for name in grads[0]}
    return logps, averaged


CASES = [
    pytest.param(2, "llama", False, False, 1, id="zero2-llama"),
    pytest.param(3, "llama", False, False, 1, id="zero3-llama"),
    pytest.param(3, "qwen2", True, False, 1, id="zero3-qwen2-tied"),
    pytest.param(2, "qwen2", True, True, 2, id="zero2-qwen2-tied-lora-accumulation2"),
    pytest.param(3, "llama", False, True, 2, id="zero3-llama-lora-accumulation2"),
]


@pytest.mark.parametrize("stage, family, tied, lora, accumulation", CASES)
def test_deepspeed_matches_dense(monkeypatch, stage, family, tied, lora, accumulation):
    # The workers import deepspeed (with this module), which picks its accelerator on import: DeepSpeed's CPU one,
    # with gloo, also on machines that have a GPU.
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    manager = mp.Manager()
    results = manager.dict()
    args = (free_port(), results, stage, family, tied, lora, accumulation)
    mp.spawn(_worker, args=args, nprocs=2, join=True)
    dense_logps, dense_grads = _dense_reference(family, tied, lora, accumulation)
    for rank in range(2):
        got = results[rank]
        for key in ("scored", "logps", "chunked"):
            for micro_batch in range(accumulation):
                error = (got[key][micro_batch] - dense_logps[rank, micro_batch]).abs().max()
                assert error <= 1e-5, (rank, key, micro_batch)
        for key in ("grads", "chunked_grads"):
            for name, reference in dense_grads.items():
                grad = got[key][name]
                assert grad is not None, (rank, key, name)
                error = (grad - reference).norm().item()
                assert error <= 1e-4 * reference.norm().item() + 1e-8, (rank, key, name, error)


_START_PAST_A_STALE_LOCK = """
from support.distributed import free_port, init_deepspeed_gloo, set_rank_environment
set_rank_environment(0, free_port(), world_size=1)
init_deepspeed_gloo(timeout_s=30)
print("started")
"""


def test_deepspeed_starts_past_a_stale_compile_lock(tmp_path):
    """The tests' DeepSpeed starts do not wait on a compile lock that a killed process left in the extensions cache
    (DeepSpeed's CPU backend would otherwise wait on it forever: the whole suite then ran into CI's time limit)."""
    import os
    import pathlib
    import subprocess
    import sys

    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "lock").touch()
    tests_dir = str(pathlib.Path(__file__).resolve().parents[1])
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=tests_dir)
    done = subprocess.run(
        [sys.executable, "-c", _START_PAST_A_STALE_LOCK], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "started" in done.stdout
