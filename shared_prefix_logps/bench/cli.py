"""``shared-prefix-logps``: the command line (``bench``, ``demo`` and ``plan``)."""

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


def package_version() -> str:
    """The installed distribution's version, or the package's own where it is not installed (a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shared-prefix-logps")
    except PackageNotFoundError:
        import shared_prefix_logps

        return shared_prefix_logps.__version__


def build_parser() -> argparse.ArgumentParser:
    """The ``shared-prefix-logps`` parser with its ``bench``, ``demo`` and ``plan`` subcommands."""
    from .presets import PRESETS

    parser = argparse.ArgumentParser(
        prog="shared-prefix-logps",
        description="Benchmark, demo and memory planner of shared-prefix-logps (per-token log-probs of G completions "
        "per prompt, each prompt forwarded once).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench,demo,plan}")
    bench = sub.add_parser(
        "bench",
        help="benchmark methods side by side on GRPO-shaped batches",
        description="Time, peak memory, agreement with dense, token counts and floors of each method on GRPO-shaped "
        "batches (B prompts x G completions); one record per method, shape and workload.",
    )
    with_cuda = {name: values[0] for name, values in BENCH_CUDA_DEFAULTS.items()}
    without = {name: values[1] for name, values in BENCH_CUDA_DEFAULTS.items()}
    bench.add_argument(
        "--model",
        "--preset",
        dest="model",
        default=None,
        help=f"model shape, built with random weights: a preset ({', '.join(sorted(PRESETS))}) or a config.json path "
        f"(or its directory) (default: {with_cuda['model']} with CUDA, {without['model']} without)",
    )
    bench.add_argument(
        "--layers", type=int, default=None, help="override the preset's depth, or keep a config's first layers"
    )
    bench.add_argument("--prompts", type=int, default=2, help="B, prompts per batch (default: %(default)s)")
    bench.add_argument(
        "--prompt-len",
        type=int,
        nargs="+",
        default=None,
        help="P, the longest prompt's real tokens; several values sweep "
        f"(default: {with_cuda['prompt_len'][0]} with CUDA, {without['prompt_len'][0]} without)",
    )
    bench.add_argument(
        "--completion-len",
        type=int,
        nargs="+",
        default=None,
        help="C, completion width (C/2..C real tokens each); several values sweep "
        f"(default: {with_cuda['completion_len'][0]} with CUDA, {without['completion_len'][0]} without)",
    )
    bench.add_argument(
        "--generations", type=int, nargs="+", default=[8], help="G, completions per prompt; several values sweep"
    )
    bench.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma-separated methods to run (also flash; with --tree-workload: dense, one_level, tree); "
        "default: %(default)s",
    )
    bench.add_argument(
        "--workloads",
        default="score,train",
        help="score (no-grad log-probs) and/or train (forward + backward), comma-separated",
    )
    bench.add_argument("--repeats", type=int, default=3, help="timed repeats per method; the median is kept")
    bench.add_argument("--device", default=None, help="cuda or cpu (default: cuda where it is available)")
    bench.add_argument(
        "--dtype", choices=["bf16", "fp32"], default=None, help="model dtype (default: bf16 on CUDA, fp32 on CPU)"
    )
    bench.add_argument(
        "--threads", type=int, default=None, help="CPU threads (default: 1 on CPU, torch's with CUDA; 0: torch's)"
    )
    bench.add_argument(
        "--output",
        default=None,
        help="directory for JSON, Markdown and PNG results; each record is also appended to <name>.jsonl there "
        "as soon as it is measured",
    )
    bench.add_argument("--name", default=None, help="file stem of the results (default: bench)")
    bench.add_argument(
        "--max-generations", action="store_true", help="also find the largest G that fits per method (train)"
    )
    bench.add_argument(
        "--tree-workload",
        choices=["agentic", "turns", "forks"],
        default=None,
        help="benchmark a prefix-tree workload instead (methods dense, one_level, tree; bench/tree_runner.py)",
    )
    bench.add_argument(
        "--tree-option",
        action="append",
        metavar="KEY=VALUE",
        help="scale the tree workload: a keyword of its builder in bench/tree_workloads.py, e.g. prompts=4 "
        "(repeatable; default: the preset's own shapes)",
    )
    bench.add_argument(
        "--dense-tokens",
        type=int,
        default=8192,
        help="tree workloads: the most tokens of one micro-batch of rows of the dense method",
    )
    demo = sub.add_parser(
        "demo",
        help="the CPU/GPU demo (same as python -m shared_prefix_logps.bench.demo)",
        description="Shared vs dense log-probs on a random model: tokens, time, memory. Options after `demo` go to "
        "the demo itself: `shared-prefix-logps demo --help` lists them.",
        add_help=False,
    )
    demo.add_argument("rest", nargs=argparse.REMAINDER, help="the demo's own options (--help lists them)")
    from ..plan import cli as plan_cli

    plan_cli.add_arguments(
        sub.add_parser(
            "plan",
            help="predicted peak memory and FLOPs of every method",
            description="Predicted peak memory per device (with its largest terms), whether it fits, FLOPs, token and "
            "FLOP floors, the largest G that fits and chunked_backward's generations_per_chunk; nothing is run.",
        )
    )
    return parser


def main(argv=None) -> int:
    """Entry point of the ``shared-prefix-logps`` command."""
    from ..plan import cli as plan_cli

    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        # argparse's REMAINDER does not take option-like words, so the demo's options bypass this parser.
        from .demo import main as demo_main

        demo_main(argv[1:])
        return 0
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_cli.run(args)
    from .run_info import fill_cuda_defaults

    fill_cuda_defaults(args, BENCH_CUDA_DEFAULTS)
    if args.tree_workload:
        from .tree_runner import run_tree_bench

        return run_tree_bench(args, methods_given=args.methods != DEFAULT_METHODS)
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
