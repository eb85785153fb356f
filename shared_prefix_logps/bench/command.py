"""``shared-prefix-logps bench``: its options and what it runs (the command line itself: ``cli.py``)."""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

# torch, transformers and the benchmark's modules are imported by the commands that run, not here: `--help` of every
# subcommand answers without loading them.

#: The methods `bench` runs on GRPO-shaped batches when --methods is not given.
DEFAULT_METHODS = "dense,trl,kv_expand,prefix_grouper,liger,expand,flex,chunked"

#: `bench` defaults that depend on whether CUDA is there: (with CUDA, without), filled in by
#: :func:`~.run_info.fill_cuda_defaults`.
BENCH_CUDA_DEFAULTS = {
    "model": ("qwen2.5-1.5b", "tiny"),
    "prompt_len": ([1024], [64]),
    "completion_len": ([256], [16]),
    "device": ("cuda", "cpu"),
}


def _bench(args) -> int:
    import torch

    from .methods import METHODS
    from .report import FLOP_BOUND_TOLERANCE, RecordStream, beyond_flop_bound, markdown_table, write_json, write_plots
    from .run_info import build_bench_model, load_average, progress_bar, run_meta, set_cpu_threads
    from .runner import Shape, find_max_generations, run_sweep

    device = torch.device(args.device)
    try:
        set_cpu_threads(args.threads, device)
    except ValueError as error:
        raise SystemExit(f"--{error}") from None
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if not methods:
        raise SystemExit(f"--methods: no method given; choose from {', '.join(METHODS)}")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    workloads = [w.strip() for w in args.workloads.split(",")]
    if not set(workloads) <= {"score", "train"}:
        raise SystemExit("--workloads takes score and/or train")
    model = build_bench_model(args, dtype, device)
    try:
        shapes = [
            Shape(args.prompts, p, c, g)
            for p, c, g in itertools.product(args.prompt_len, args.completion_len, args.generations)
        ]
    except ValueError as error:
        raise SystemExit(f"--prompts/--prompt-len/--completion-len/--generations: {error}") from None
    total = len(shapes) * len(workloads) * len(methods)
    bar = progress_bar(total)
    stream = RecordStream(Path(args.output) / f"{args.name or 'bench'}.jsonl") if args.output else None

    def progress(record):
        if stream is not None:
            stream.write(record)
        figures = f" {record['median_ms']:.1f} ms" if record.get("median_ms") is not None else ""
        bar(
            f"{record['method']} {record['workload']} P={record['prompt_len']} G={record['generations']}: "
            f"{record['status']}{figures}"
        )

    load_before = load_average()
    records = run_sweep(model, methods, shapes, workloads, repeats=args.repeats, progress=progress)
    meta = run_meta(
        args,
        dtype,
        device,
        load_before,
        timing="interleaved: per repeat one timed step of every method in turn; median per method",
    )
    if args.max_generations:
        p, c = args.prompt_len[0], args.completion_len[0]
        meta["max_generations"] = {
            "prompt_len": p,
            "completion_len": c,
            "prompts": args.prompts,
            "by_method": {m: find_max_generations(model, m, args.prompts, p, c) for m in methods},
        }
    table = markdown_table(records)
    print(table)
    for r in beyond_flop_bound(records):
        print(
            f"warning: {r['method']} {r['workload']} P={r['prompt_len']} G={r['generations']} is faster than dense by "
            f"more than {1 + FLOP_BOUND_TOLERANCE:g} / flop_floor: dense did work the floors do not count, or the "
            "timing is noise",
            file=sys.stderr,
        )
    if "max_generations" in meta:
        print(f"largest G that fits (train, P={p}, C={c}): {meta['max_generations']['by_method']}")
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        stem = args.name or "bench"
        write_json(records, out / f"{stem}.json", meta)
        (out / f"{stem}.md").write_text(_markdown_report(meta, table))
        for path in write_plots(records, out, prefix=f"{stem}-"):
            print(f"wrote {path}")
        print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")
    return 1 if any(r["status"] == "error" for r in records) else 0


def _markdown_report(meta: dict, table: str) -> str:
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    load = meta.get("load_average") or {}
    lines = [
        f"# Benchmark: {meta['preset']} on {meta['device']}",
        "",
        f"dtype {meta['dtype']}; commit {meta['commit']}; {versions}",
        "",
        f"threads {meta['threads']}; load average (1, 5, 15 min) before {load.get('before')}, after "
        f"{load.get('after')}; timing {meta['timing']}.",
        "",
        "Token counts and both floors count real tokens only. token floor: tokens the shared path forwards over "
        "those of the dense rows; FLOP floor: model-config FLOPs of the least work the shared path could do over "
        "those of the dense method (attention and head included; forward+backward for train). of FLOP bound: the "
        "speed-up over dense times the FLOP floor (1.00: as fast as the floor allows at dense's efficiency).",
        "",
        table,
    ]
    if "max_generations" in meta:
        mg = meta["max_generations"]
        lines += ["", f"Largest G that fits (train, P={mg['prompt_len']}, C={mg['completion_len']}): {mg['by_method']}"]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options on ``parser``."""
    from .presets import PRESETS

    with_cuda = {name: values[0] for name, values in BENCH_CUDA_DEFAULTS.items()}
    without = {name: values[1] for name, values in BENCH_CUDA_DEFAULTS.items()}
    parser.add_argument(
        "--model",
        "--preset",
        dest="model",
        default=None,
        help=f"model shape, built with random weights: a preset ({', '.join(sorted(PRESETS))}) or a config.json path "
        f"(or its directory) (default: {with_cuda['model']} with CUDA, {without['model']} without)",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="override the preset's depth, or keep a config's first layers"
    )
    parser.add_argument("--prompts", type=int, default=2, help="B, prompts per batch (default: %(default)s)")
    parser.add_argument(
        "--prompt-len",
        type=int,
        nargs="+",
        default=None,
        help="P, the longest prompt's real tokens; several values sweep "
        f"(default: {with_cuda['prompt_len'][0]} with CUDA, {without['prompt_len'][0]} without)",
    )
    parser.add_argument(
        "--completion-len",
        type=int,
        nargs="+",
        default=None,
        help="C, completion width (C/2..C real tokens each); several values sweep "
        f"(default: {with_cuda['completion_len'][0]} with CUDA, {without['completion_len'][0]} without)",
    )
    parser.add_argument(
        "--generations",
        type=int,
        nargs="+",
        default=None,
        help="G, completions per prompt; several values sweep (default: 8; with --count-kernels: the scoring step's "
        "G then the training step's, default 16 4)",
    )
    parser.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma-separated methods to run (also flash; with --tree-workload: dense, two_level, tree); "
        "default: %(default)s",
    )
    parser.add_argument(
        "--workloads",
        default="score,train",
        help="score (no-grad log-probs) and/or train (forward + backward), comma-separated",
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per method; the median is kept")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda where it is available)")
    parser.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="model dtype (default: bf16 on CUDA, fp32 on CPU)"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: 1 on CPU, torch's with CUDA; 0: torch's)"
    )
    parser.add_argument(
        "--output",
        default=None,
        help="directory for JSON, Markdown and PNG results; each record is also appended to <name>.jsonl there "
        "as soon as it is measured",
    )
    parser.add_argument("--name", default=None, help="file stem of the results (default: bench)")
    parser.add_argument(
        "--max-generations", action="store_true", help="also find the largest G that fits per method (train)"
    )
    parser.add_argument(
        "--tree-workload",
        choices=["agentic", "turns", "forks"],
        default=None,
        help="benchmark a prefix-tree workload instead (methods dense, two_level, tree; bench/tree_runner.py)",
    )
    parser.add_argument(
        "--tree-option",
        action="append",
        metavar="KEY=VALUE",
        help="scale the tree workload: a keyword of its builder in bench/tree_workloads.py, e.g. prompts=4 "
        "(repeatable; default: the preset's own shapes)",
    )
    parser.add_argument(
        "--count-kernels",
        action="store_true",
        help="instead of timing, count on CPU what each method's step would cost a GPU's host (kernel launches, host "
        "syncs by call site, gradient additions) on the preset's structure with narrow widths "
        "(bench/kernel_count.py)",
    )
    parser.add_argument(
        "--dense-tokens",
        type=int,
        default=8192,
        help="tree workloads: the most tokens of one micro-batch of rows of the dense method",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``shared-prefix-logps bench`` with the parsed ``args``; the exit code."""
    from .run_info import fill_cuda_defaults

    if args.count_kernels:
        from .kernel_count import run_count

        return run_count(args)
    fill_cuda_defaults(args, BENCH_CUDA_DEFAULTS)
    if args.generations is None:
        args.generations = [8]
    if args.tree_workload:
        from .tree_runner import run_tree_bench

        return run_tree_bench(args, methods_given=args.methods != DEFAULT_METHODS)
    return _bench(args)
