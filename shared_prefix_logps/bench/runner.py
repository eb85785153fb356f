"""Run methods over shapes and record time, peak memory and agreement with the dense path."""

from __future__ import annotations

import gc
import itertools
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .memory import peak_memory
from .methods import METHODS, Batch, method_unavailable


@dataclass(frozen=True)
class Shape:
    prompts: int
    prompt_len: int
    completion_len: int
    generations: int

    @property
    def dense_tokens(self) -> int:
        return self.prompts * self.generations * (self.prompt_len + self.completion_len)

    @property
    def shared_tokens(self) -> int:
        return self.prompts * (self.prompt_len + self.generations * self.completion_len)


def make_batch(shape: Shape, vocab: int, device, seed: int = 0) -> Batch:
    """Prompts of true lengths from P/2 to P (left-padded), completions of C/2 to C tokens (right-padded)."""
    gen = torch.Generator().manual_seed(seed)
    p, c, rows = shape.prompt_len, shape.completion_len, shape.prompts * shape.generations
    prompt_lengths = torch.linspace(max(1, p // 2), p, shape.prompts).long()
    completion_lengths = torch.randint(max(1, c // 2), c + 1, (rows,), generator=gen)
    completion_lengths[0] = c
    return Batch(
        prompts=torch.randint(0, vocab, (shape.prompts, p), generator=gen).to(device),
        prompt_mask=(torch.arange(p)[None] >= (p - prompt_lengths)[:, None]).to(device),
        completions=torch.randint(0, vocab, (rows, c), generator=gen).to(device),
        completion_mask=(torch.arange(c)[None] < completion_lengths[:, None]).to(device),
    )


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_ms(step, model, batch, train, repeats, device) -> float:
    times = []
    for i in range(repeats + 1):  # the first run warms up (compilation, caches)
        model.zero_grad(set_to_none=True)
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(model, batch, train)
            end.record()
            torch.cuda.synchronize(device)
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            step(model, batch, train)
            elapsed = (time.perf_counter() - t0) * 1e3
        if i:
            times.append(elapsed)
    return statistics.median(times) if times else elapsed


def run_one(model, method: str, shape: Shape, workload: str, *, repeats: int, reference=None) -> dict:
    """One record: the method on one shape and workload (``score`` or ``train``)."""
    device = next(model.parameters()).device
    train = workload == "train"
    record = dict(
        method=method,
        workload=workload,
        **asdict(shape),
        device=str(device),
        dense_tokens=shape.dense_tokens,
        shared_tokens=shape.shared_tokens,
        token_floor=shape.shared_tokens / shape.dense_tokens,
    )
    reason = method_unavailable(method, device, train)
    if reason is not None:
        return {**record, "status": "skipped", "reason": reason}
    step = METHODS[method][0]
    batch = make_batch(shape, model.config.vocab_size, device)
    try:
        logps = step(model, batch, train)
        if reference is not None:
            record["max_abs_diff_vs_dense"] = float((logps - reference).abs().max())
        record["median_ms"] = _time_ms(step, model, batch, train, repeats, device)
        record["tokens_per_s"] = shape.dense_tokens / (record["median_ms"] / 1e3)
        if device.type == "cpu" and method == "flex":
            record["peak_bytes"] = None  # the CPU live-bytes tracker cannot see inside flex_attention
        else:
            model.zero_grad(set_to_none=True)
            with peak_memory(device) as mem:
                step(model, batch, train)
            record["peak_bytes"] = mem["peak_bytes"]
        record["status"] = "ok"
        record["_logps"] = logps
    except Exception as error:  # an OOM is a result, anything else a failure: both are recorded, not raised
        if not _is_oom(error):
            record.update(status="error", reason=f"{type(error).__name__}: {error}"[:300])
        else:
            record.update(status="OOM")
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return record


def run_sweep(model, methods, shapes, workloads, *, repeats: int = 3, progress=None) -> list[dict]:
    """Every (shape, workload, method); ``dense`` runs first in each cell so the others are checked against it."""
    ordered = ["dense"] + [m for m in methods if m != "dense"] if "dense" in methods else list(methods)
    records = []
    cells = list(itertools.product(shapes, workloads))
    for shape, workload in cells:
        reference = None
        for method in ordered:
            record = run_one(model, method, shape, workload, repeats=repeats, reference=reference)
            logps = record.pop("_logps", None)
            if method == "dense" and logps is not None:
                reference = logps
            records.append(record)
            if progress is not None:
                progress(record)
    return records


def find_max_generations(model, method, prompts, prompt_len, completion_len, workload="train", limit=1024):
    """Largest power-of-two G for which one step of ``method`` fits in memory (0 if even G=1 does not)."""
    best, g = 0, 1
    while g <= limit:
        record = run_one(model, method, Shape(prompts, prompt_len, completion_len, g), workload, repeats=0)
        if record["status"] != "ok":
            break
        best, g = g, g * 2
    return best
