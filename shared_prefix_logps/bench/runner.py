"""Run methods over shapes and record time, peak memory, agreement with the dense path, and the real work.

Every record counts real tokens only (pads are nobody's work) and carries two floors, the least fraction of the
dense method's work the shared path could do: ``token_floor`` (tokens forwarded) and ``flop_floor`` (model-config
FLOPs, :mod:`.flops`: attention and the head do not shrink with sharing as the body does). At equal efficiency no
method can be faster than dense by more than ``1 / flop_floor``.

On one shape the methods' timed runs are interleaved (a round over every method per repeat, the median per method),
so background load on a shared machine slows them alike.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from .flops import ModelShape, Workload, flop_floor
from .memory import long_lived_objects_frozen, peak_memory
from .methods import METHODS, Batch, method_unavailable


@dataclass(frozen=True)
class Shape:
    """A benchmark shape: ``prompts`` (B) prompts of at most ``prompt_len`` (P) tokens, the longest exactly P,
    each with ``generations`` (G) completions of at most ``completion_len`` (C) tokens."""

    prompts: int
    prompt_len: int
    completion_len: int
    generations: int

    def __post_init__(self):
        for name in ("prompts", "prompt_len", "completion_len", "generations"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")


def make_batch(shape: Shape, vocab: int, device, seed: int = 0) -> Batch:
    """Prompts of real lengths from P down to about P/2 (the first exactly P; left-padded to P), completions of C/2
    to C real tokens (the first exactly C; right-padded to C)."""
    gen = torch.Generator().manual_seed(seed)
    p, c, rows = shape.prompt_len, shape.completion_len, shape.prompts * shape.generations
    prompt_lengths = torch.linspace(p, max(1, p // 2), shape.prompts).round().long()
    completion_lengths = torch.randint(max(1, c // 2), c + 1, (rows,), generator=gen)
    completion_lengths[0] = c
    return Batch(
        prompts=torch.randint(0, vocab, (shape.prompts, p), generator=gen).to(device),
        prompt_mask=(torch.arange(p)[None] >= (p - prompt_lengths)[:, None]).to(device),
        completions=torch.randint(0, vocab, (rows, c), generator=gen).to(device),
        completion_mask=(torch.arange(c)[None] < completion_lengths[:, None]).to(device),
    )


def work_counts(config, batch: Batch, train: bool) -> dict:
    """The real work of ``batch``: tokens (``prompt_tokens`` of the distinct prompts, ``completion_tokens``,
    ``dense_tokens`` and ``shared_tokens`` forwarded by the full rows and by a shared prefix) and both floors."""
    workload = Workload.from_masks(batch.prompt_mask.cpu(), batch.completion_mask.cpu())
    return dict(
        prompt_tokens=workload.prompt_tokens,
        completion_tokens=workload.completion_tokens,
        dense_tokens=workload.dense_tokens,
        shared_tokens=workload.shared_tokens,
        token_floor=workload.shared_tokens / workload.dense_tokens,
        flop_floor=flop_floor(ModelShape.from_config(config), workload, train=train),
    )


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def failure_record(error: BaseException) -> dict:
    """An OOM is a result, anything else a failure: both are recorded, not raised."""
    if _is_oom(error):
        return {"status": "OOM"}
    return {"status": "error", "reason": f"{type(error).__name__}: {error}"[:300]}


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _cleanup(model, device):
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _time_ms(step, model, batch, train, device) -> float:
    """Milliseconds of one step (CUDA events on CUDA, wall clock elsewhere)."""
    model.zero_grad(set_to_none=True)
    synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(model, batch, train)
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    step(model, batch, train)
    return (time.perf_counter() - t0) * 1e3


def run_cell(model, methods, shape: Shape, workload: str, *, repeats: int, on_record=None) -> list[dict]:
    """One record per method on one shape and workload (``score`` or ``train``), all on the same batch.

    ``dense`` runs first: its log-probs are the reference of the others' ``max_abs_diff_vs_dense``. Each method's
    first run warms it up (compilation, caches) and gives its log-probs; then ``repeats`` rounds time every method
    once each, in turn; then its peak memory is measured apart (the CPU tracker slows the work down). With
    ``repeats=0`` the warm-up run's time is recorded.

    ``on_record(record)`` is called with each method's record as soon as it is final (skipped, failed, or measured),
    before the cell's other methods finish: a run stopped midway keeps what it measured.
    """
    with long_lived_objects_frozen():
        return _run_cell(model, methods, shape, workload, repeats=repeats, on_record=on_record)


def _run_cell(model, methods, shape: Shape, workload: str, *, repeats: int, on_record=None) -> list[dict]:
    done = on_record or (lambda record: None)
    device = next(model.parameters()).device
    train = workload == "train"
    batch = make_batch(shape, model.config.vocab_size, device)
    base = dict(workload=workload, **asdict(shape), device=str(device), **work_counts(model.config, batch, train))
    ordered = ["dense"] + [m for m in methods if m != "dense"] if "dense" in methods else list(methods)
    records = {method: dict(method=method, **base) for method in ordered}
    times: dict[str, list[float]] = {}
    reference = None
    for method in ordered:
        record = records[method]
        reason = method_unavailable(method)
        if reason is not None:
            record.update(status="skipped", reason=reason)
            done(record)
            continue
        step = METHODS[method][0]
        try:
            model.zero_grad(set_to_none=True)
            synchronize(device)
            t0 = time.perf_counter()
            logps = step(model, batch, train)
            synchronize(device)
            warmup_ms = (time.perf_counter() - t0) * 1e3
            if method == "dense":
                reference = logps
            elif reference is not None:
                record["max_abs_diff_vs_dense"] = float((logps - reference).abs().max())
            times[method] = [] if repeats else [warmup_ms]
        except Exception as error:
            record.update(failure_record(error))
            done(record)
        finally:
            _cleanup(model, device)
    for _ in range(repeats):
        for method in list(times):
            try:
                times[method].append(_time_ms(METHODS[method][0], model, batch, train, device))
            except Exception as error:
                records[method].update(failure_record(error))
                done(records[method])
                del times[method]
                _cleanup(model, device)
    for method, samples in times.items():
        record = records[method]
        step = METHODS[method][0]
        record["median_ms"] = statistics.median(samples)
        # The same real tokens for every method, so it compares them: row tokens scored per second.
        record["tokens_per_s"] = record["dense_tokens"] / (record["median_ms"] / 1e3)
        try:
            if device.type == "cpu" and method == "flex":
                record["peak_bytes"] = None  # the CPU live-bytes tracker cannot see inside flex_attention
            else:
                model.zero_grad(set_to_none=True)
                with peak_memory(device) as mem:
                    step(model, batch, train)
                record["peak_bytes"] = mem["peak_bytes"]
            record["status"] = "ok"
        except Exception as error:
            record.update(failure_record(error))
        finally:
            _cleanup(model, device)
        done(record)
    return [records[method] for method in ordered]


def run_sweep(model, methods, shapes, workloads, *, repeats: int = 3, progress=None) -> list[dict]:
    """Every (shape, workload) cell, each method of a cell on the same batch (:func:`run_cell`); ``progress(record)``
    is called with each record as soon as it is final (a streamed results file writes it then)."""
    records = []
    for shape in shapes:
        for workload in workloads:
            records += run_cell(model, methods, shape, workload, repeats=repeats, on_record=progress)
    return records


def find_max_generations(model, method, prompts, prompt_len, completion_len, workload="train", limit=1024):
    """Largest power-of-two G for which one step of ``method`` fits in memory (0 if even G=1 does not)."""
    best, g = 0, 1
    while g <= limit:
        (record,) = run_cell(model, [method], Shape(prompts, prompt_len, completion_len, g), workload, repeats=0)
        if record["status"] != "ok":
            break
        best, g = g, g * 2
    return best
