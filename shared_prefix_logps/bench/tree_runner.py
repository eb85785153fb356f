"""Run the tree benchmark: the methods of :mod:`.tree_methods` on one prefix-tree workload (:mod:`.tree_workloads`),
recording the tokens and FLOPs each forwards, time, peak memory and agreement with ``dense``.

Per workload (``score``/``train``) every method first runs once under the peak-memory tracker (:mod:`.memory`; it
also warms the method up and gives its log-probs, compared with dense's), then ``repeats`` rounds time every method
once each, in turn, so background load on a shared machine slows them alike; the median per method is recorded.
"""

from __future__ import annotations

import gc
import inspect
import statistics
import time

import torch

from .flops import ModelShape
from .memory import long_lived_objects_frozen, peak_memory
from .run_info import build_bench_model, load_average, progress_bar, run_meta, set_cpu_threads
from .runner import failure_record, synchronize
from .tree_flops import method_flops
from .tree_methods import DEFAULT_DENSE_TOKENS, TREE_METHODS, TreeCase
from .tree_workloads import WORKLOADS, TreeWorkload, forwarded_tokens

#: How far beyond the floor's speed-up a measured one may land before it is flagged (timing noise).
FLOOR_TOLERANCE = 0.1


def _cleanup(model) -> None:
    model.zero_grad(set_to_none=True)
    gc.collect()


def _timed(step, model, case, train, device) -> tuple[torch.Tensor, float]:
    model.zero_grad(set_to_none=True)
    synchronize(device)
    t0 = time.perf_counter()
    logps = step(model, case, train)
    synchronize(device)
    return logps, (time.perf_counter() - t0) * 1e3


def cell_base(config, workload: TreeWorkload, train: bool) -> dict:
    """What every method's record of ``workload`` shares: tokens forwarded by each method (``tokens_<method>``),
    FLOPs of each (``flops_<method>``), the FLOP floor (unique over dense) and its speed-up over dense."""
    counts = forwarded_tokens(workload)
    flops = method_flops(ModelShape.from_config(config), workload, train=train)
    return dict(
        tree_workload=workload.name,
        workload="train" if train else "score",
        rows=int(workload.input_ids.shape[0]),
        scored_tokens=int(workload.score_mask.sum()),
        **{f"tokens_{name}": count for name, count in counts.items()},
        **{f"flops_{name}": f.total for name, f in flops.items()},
        flop_floor=flops["unique"].total / flops["dense"].total,
        floor_speedup=flops["dense"].total / flops["unique"].total,
    )


def run_tree_cell(
    model,
    methods,
    workload: TreeWorkload,
    train: bool,
    *,
    repeats: int,
    dense_tokens: int = DEFAULT_DENSE_TOKENS,
    on_record=None,
) -> list[dict]:
    """One record per method on ``workload`` (``train``: forward and backward of the summed scored log-probs).

    ``on_record(record)`` is called with each method's record as soon as it is final (failed, or measured once the
    timing rounds are over), with the load average from the cell's start to then: a run stopped midway keeps what it
    measured.
    """
    with long_lived_objects_frozen():
        return _run_tree_cell(
            model, methods, workload, train, repeats=repeats, dense_tokens=dense_tokens, on_record=on_record
        )


def _run_tree_cell(model, methods, workload, train, *, repeats, dense_tokens, on_record) -> list[dict]:
    device = next(model.parameters()).device
    case = TreeCase.of(workload, device, dense_tokens=dense_tokens)
    base = cell_base(model.config, workload, train)
    ordered = ["dense"] + [m for m in methods if m != "dense"] if "dense" in methods else list(methods)
    records = {
        m: dict(method=m, **base, tokens_forwarded=base[f"tokens_{m}"], flops=base[f"flops_{m}"]) for m in ordered
    }
    if "dense" in records:
        groups = case.dense_groups()
        records["dense"].update(micro_batches=len(groups), micro_batch_tokens=dense_tokens)
    if train:
        for m in ("two_level", "tree"):
            if m in records:
                records[m]["chunk_rows"] = case.chunk_rows
    load_before = load_average()

    def finish(record):
        record["load_average"] = dict(before=load_before, after=load_average())
        if on_record is not None:
            on_record(record)

    times: dict[str, list[float]] = {}
    reference = None
    for method in ordered:
        record, step = records[method], TREE_METHODS[method]
        try:
            _cleanup(model)
            embedded = []
            hook = model.get_input_embeddings().register_forward_pre_hook(
                lambda _, args, counts=embedded: counts.append(args[0].numel())
            )
            try:
                with peak_memory(device) as mem:
                    logps, record["tracked_ms"] = _timed(step, model, case, train, device)
            finally:
                hook.remove()
            # Pads included: what the model embedded (two_level pads prompts of different lengths).
            record.update(peak_bytes=mem["peak_bytes"], tokens_embedded=sum(embedded))
            if method == "dense":
                reference = logps
            elif reference is not None:
                record["max_abs_diff_vs_dense"] = float((logps - reference).abs().max())
            times[method] = []
        except Exception as error:
            record.update(failure_record(error))
            finish(record)
        finally:
            _cleanup(model)
    for _ in range(repeats):
        for method in list(times):
            try:
                times[method].append(_timed(TREE_METHODS[method], model, case, train, device)[1])
            except Exception as error:
                records[method].update(failure_record(error))
                finish(records[method])
                del times[method]
            finally:
                _cleanup(model)
    dense_ms = None
    for method in ordered:
        record = records[method]
        if method not in times:
            continue
        samples = times[method] or [record["tracked_ms"]]
        record.update(status="ok", times_ms=samples, median_ms=statistics.median(samples), timed=bool(times[method]))
        if method == "dense":
            dense_ms = record["median_ms"]
        if dense_ms is not None:
            record["speedup"] = dense_ms / record["median_ms"]
            record["of_floor"] = record["speedup"] / record["floor_speedup"]
        finish(record)
    return [records[m] for m in ordered]


def build_workload(name: str, options: dict, vocab: int) -> tuple[TreeWorkload, dict]:
    """The preset ``name`` of :data:`WORKLOADS` with ``options`` (its builder's keywords) over ``vocab`` token ids;
    returns it and the builder's full keywords (defaults included), which rebuild it."""
    if name not in WORKLOADS:
        raise ValueError(f"tree workload: unknown {name!r}; choose from {', '.join(WORKLOADS)}")
    builder = WORKLOADS[name]
    parameters = inspect.signature(builder).parameters
    unknown = sorted(set(options) - set(parameters))
    if unknown:
        raise ValueError(f"tree option(s) {unknown} unknown to {name}; it takes {', '.join(parameters)}")
    negative = sorted(key for key, value in options.items() if value < 0)
    if negative:
        raise ValueError(f"tree option(s) {negative} must not be negative")
    if not 1 <= options.get("vocab", vocab) <= vocab:
        raise ValueError(f"tree option vocab={options['vocab']} must be in [1, {vocab}], the model's vocabulary")
    kwargs = {key: p.default for key, p in parameters.items()}
    kwargs.update({"vocab": vocab, **options})
    workload = builder(**kwargs)
    if not bool(workload.score_mask.any()):
        raise ValueError(f"{name} with {_describe(options)} scores no token; each count it takes must be positive")
    return workload, kwargs


def _describe(options: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in options.items()) or "its defaults"


def parse_options(items: list[str] | None) -> dict[str, int]:
    """``KEY=VALUE`` strings (integer values) as a dict."""
    options = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"tree option {item!r}: expected KEY=VALUE")
        try:
            options[key.strip()] = int(value)
        except ValueError:
            raise ValueError(f"tree option {item!r}: VALUE must be an integer") from None
    return options


def flagged_beyond_floor(records: list[dict], tolerance: float = FLOOR_TOLERANCE) -> list[dict]:
    """The records faster than dense by more than ``(1 + tolerance)`` times the floor's speed-up: at equal efficiency
    none can be, so each one means dense did work the floor does not count, or timing noise."""
    return [r for r in records if r.get("speedup") is not None and r["speedup"] > (1 + tolerance) * r["floor_speedup"]]


def run_tree_bench(args, *, methods_given: bool) -> int:
    """``shared-prefix-logps bench --tree-workload NAME``: the tree benchmark from the parsed CLI ``args``
    (``methods_given``: whether ``--methods`` was given; else all of :data:`TREE_METHODS`)."""
    import sys
    from pathlib import Path

    from .report import RecordStream, write_json
    from .tree_report import markdown_report, markdown_table

    device = torch.device(args.device)
    try:
        set_cpu_threads(args.threads, device)
        options = parse_options(args.tree_option)
    except ValueError as error:
        raise SystemExit(f"--{error}") from None
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if methods_given else list(TREE_METHODS)
    unknown = [m for m in methods if m not in TREE_METHODS]
    if unknown:
        raise SystemExit(f"--tree-workload: unknown method(s) {unknown}; choose from {', '.join(TREE_METHODS)}")
    workloads = [w.strip() for w in args.workloads.split(",")]
    if not set(workloads) <= {"score", "train"}:
        raise SystemExit("--workloads takes score and/or train")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    model = build_bench_model(args, dtype, device)
    try:
        workload, kwargs = build_workload(args.tree_workload, options, model.config.vocab_size)
    except (ValueError, TypeError) as error:
        raise SystemExit(f"--tree-workload/--tree-option: {error}") from None
    bar = progress_bar(len(workloads) * len(methods))
    stem = args.name or f"tree-{workload.name}"
    stream = RecordStream(Path(args.output) / f"{stem}.jsonl") if args.output else None

    def progress(record):
        if stream is not None:
            stream.write(record)
        figures = f" {record['median_ms']:.1f} ms" if record.get("median_ms") is not None else ""
        bar(f"{workload.name} {record['method']} {record['workload']}: {record.get('status')}{figures}")

    load_before = load_average()
    records = []
    for name in workloads:
        records += run_tree_cell(
            model,
            methods,
            workload,
            name == "train",
            repeats=args.repeats,
            dense_tokens=args.dense_tokens,
            on_record=progress,
        )
    meta = run_meta(
        args,
        dtype,
        device,
        load_before,
        tree_workload=workload.name,
        tree_options=kwargs,
        scale="the preset's shapes" if not options else "scaled: " + ", ".join(f"{k}={v}" for k, v in options.items()),
        timing="first a run under the peak-memory tracker per method (warm-up, log-probs, peak); then per repeat one "
        "timed step of every method in turn; median per method"
        if args.repeats
        else "one run per method, in turn, under the peak-memory tracker: its time is the record's (repeats 0)",
    )
    table = markdown_table(records)
    print(table)
    for r in flagged_beyond_floor(records):
        print(
            f"warning: {r['method']} {r['workload']} is faster than dense by more than {1 + FLOOR_TOLERANCE:g} x the "
            "floor's speed-up: dense did work the floor does not count, or the timing is noise",
            file=sys.stderr,
        )
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        write_json(records, out / f"{stem}.json", meta)
        (out / f"{stem}.md").write_text(markdown_report(meta, records))
        print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")
    return 1 if any(r.get("status") == "error" for r in records) else 0
