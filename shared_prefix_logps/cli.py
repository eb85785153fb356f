"""``shared-prefix-logps``: the command line (``bench``, ``demo`` and ``plan``), the package's one CLI module.

Each subcommand's options and what it runs live with it (``bench/command.py``, ``plan/command.py``, ``bench/demo.py``);
torch, transformers and the benchmark's modules are imported by the command that runs, not here, so ``--help`` of
every subcommand answers without loading them.
"""

from __future__ import annotations

import argparse
import sys

from .bench import command as bench_command
from .plan import command as plan_command


def package_version() -> str:
    """The installed distribution's version, or the package's own where it is not installed (a bare checkout)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shared-prefix-logps")
    except PackageNotFoundError:
        from . import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    """The ``shared-prefix-logps`` parser with its ``bench``, ``demo`` and ``plan`` subcommands."""
    parser = argparse.ArgumentParser(
        prog="shared-prefix-logps",
        description="Benchmark, demo and memory planner of shared-prefix-logps (per-token log-probs of G completions "
        "per prompt, each prompt forwarded once).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{bench,demo,plan}")
    bench_command.add_arguments(
        sub.add_parser(
            "bench",
            help="benchmark methods side by side on GRPO-shaped batches",
            description="Time, peak memory, agreement with dense, token counts and floors of each method on "
            "GRPO-shaped batches (B prompts x G completions); one record per method, shape and workload.",
        )
    )
    demo = sub.add_parser(
        "demo",
        help="the CPU/GPU demo (same as python -m shared_prefix_logps.bench.demo)",
        description="Shared vs dense log-probs on a random model: tokens, time, memory. Options after `demo` go to "
        "the demo itself: `shared-prefix-logps demo --help` lists them.",
        add_help=False,
    )
    demo.add_argument("rest", nargs=argparse.REMAINDER, help="the demo's own options (--help lists them)")
    plan_command.add_arguments(
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
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        # argparse's REMAINDER does not take option-like words, so the demo's options bypass this parser.
        from .bench.demo import main as demo_main

        demo_main(argv[1:])
        return 0
    args = parser.parse_args(argv)
    if args.command == "plan":
        return plan_command.run(args)
    return bench_command.run(args)


if __name__ == "__main__":
    sys.exit(main())
