"""``shared-prefix-logps plan``: the planner's options and report (the command line itself: ``cli.py``)."""

from __future__ import annotations

import argparse
import json

from .api import max_generations, plan
from .dims import load_dims
from .flops import flop_floor
from .memory import METHODS
from .workload import DTYPE_BYTES, ENGINES, Engine, Workload, parse_memory_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``plan`` subcommand's options (the workload options mean what they mean to ``bench``)."""
    parser.add_argument("--model", required=True, help="a bench preset or a config.json path (or its directory)")
    parser.add_argument("--layers", type=int, default=None, help="override the model's depth")
    parser.add_argument(
        "--prompts", type=int, default=2, help="B, prompts per batch, per device (default: %(default)s)"
    )
    parser.add_argument("--prompt-len", type=int, required=True, help="P, padded prompt width (the longest prompt)")
    parser.add_argument(
        "--completion-len", type=int, required=True, help="C, padded completion width (the longest completion)"
    )
    parser.add_argument("--generations", type=int, required=True, help="G, completions per prompt")
    ragged = parser.add_argument_group(
        "ragged batches",
        "real token counts of batches whose prompts and completions are shorter than P and C (default: every prompt "
        "P and every completion C tokens); give the totals or the mean lengths",
    )
    ragged.add_argument("--prompt-tokens", type=int, default=None, help="real tokens of the B prompts together")
    ragged.add_argument(
        "--completion-tokens", type=int, default=None, help="real tokens of the B x G completions together"
    )
    ragged.add_argument("--mean-prompt-len", type=float, default=None, help="mean real prompt length")
    ragged.add_argument("--mean-completion-len", type=float, default=None, help="mean real completion length")
    parser.add_argument("--workload", default="train", help="score (no gradients) or train (default: %(default)s)")
    parser.add_argument("--dtype", default="bf16", help=f"one of {', '.join(DTYPE_BYTES)} (default: %(default)s)")
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="activation checkpointing of every decoder layer"
    )
    parser.add_argument("--lora-fraction", type=float, default=None, help="trainable share of parameters (LoRA)")
    parser.add_argument("--optimizer", default="adamw", help="adamw or sgd (default: %(default)s)")
    parser.add_argument(
        "--generations-per-chunk", type=int, default=None, help="chunked_backward's chunk (default: G // 4)"
    )
    parser.add_argument("--gpus", type=int, default=1, help="world size of the engine (default: %(default)s)")
    parser.add_argument("--gpu-memory", default="80GB", help="memory of one device, e.g. 80GB or 141GB")
    parser.add_argument(
        "--engine", default=None, help=f"one of {', '.join(ENGINES)} (default: single for one GPU, fsdp2 for several)"
    )
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for what `bench --device cpu` measures")
    parser.add_argument(
        "--unpadded-prompts",
        action="store_true",
        help="no prompt is left-padded (expand: one mask row for every completion)",
    )
    parser.add_argument(
        "--head-implementation",
        default=None,
        help="the fused head's statistics: triton or torch (default: triton on cuda, torch on cpu)",
    )
    parser.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="compute_logps's token_budget: the most tokens a no-grad chunk of rows forwards (default: the library's)",
    )
    parser.add_argument(
        "--sdpa-repeats-kv",
        default=None,
        choices=("yes", "no"),
        help="whether expand's CUDA attention kernel needs grouped KV heads repeated (no: cuDNN on sm90 takes them "
        "natively); default: not known, the larger prediction",
    )
    parser.add_argument(
        "--methods", default=",".join(METHODS), help="comma-separated methods to plan (default: %(default)s)"
    )
    parser.add_argument("--max-generations", action="store_true", help="also the largest power-of-two G that fits")
    parser.add_argument("--json", action="store_true", help="one JSON record per method instead of a table")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def run(args: argparse.Namespace) -> int:
    """Print the plan for ``args``; errors in the options exit with a message naming the option."""
    try:
        methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        if not methods:
            raise ValueError(f"--methods: no method given; choose from {', '.join(METHODS)}")
        unknown = [m for m in methods if m not in METHODS]
        if unknown:
            raise ValueError(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
        dims = load_dims(args.model).with_layers(args.layers)
        prompt_tokens, completion_tokens = real_token_counts(args)
        workload = Workload(
            args.prompts,
            args.prompt_len,
            args.completion_len,
            args.generations,
            prompt_tokens=prompt_tokens,
            scored_tokens=completion_tokens,
            mode=args.workload,
            dtype=args.dtype,
            gradient_checkpointing=args.gradient_checkpointing,
            lora_fraction=args.lora_fraction,
            optimizer=args.optimizer,
            generations_per_chunk=args.generations_per_chunk,
            padded_prompts=not args.unpadded_prompts,
            token_budget=args.token_budget,
        )
        kind = args.engine or ("single" if args.gpus == 1 else "fsdp2")
        memory = parse_memory_size(args.gpu_memory)
        repeats = None if args.sdpa_repeats_kv is None else args.sdpa_repeats_kv == "yes"
        engine = Engine(
            kind, args.gpus, args.device, memory, head_implementation=args.head_implementation, repeats_kv=repeats
        )
    except (TypeError, ValueError) as error:
        raise SystemExit(f"shared-prefix-logps plan: {_with_option(error)}") from error
    plans = plan(dims, workload, engine, methods)
    best_g = {}
    if args.max_generations:
        best_g = {p.memory.method: max_generations(dims, workload, engine, p.memory.method) for p in plans}
    if args.json:
        records = [{**p.record(), **({"max_generations": best_g[p.memory.method]} if best_g else {})} for p in plans]
        print(json.dumps({"model": dims.name, "workload": workload.__dict__, "methods": records}, indent=1))
        return 0
    experts = "" if dims.experts is None else f" ({dims.experts.count} experts, {dims.experts.per_token} per token)"
    real = ""
    if workload.prompt_tokens is not None or workload.scored_tokens is not None:
        real = f" ({workload.real_prompt_tokens} prompt and {workload.scored} completion tokens real)"
    print(
        f"{dims.name}: {dims.params / 1e9:.2f}B params{experts}, {dims.layers} layers; B={workload.prompts}"
        f" P={workload.prompt_len} C={workload.completion_len} G={workload.generations}{real} {workload.mode}"
        f" {workload.dtype}; {engine.kind} x {engine.world_size}, {_gib(engine.memory_bytes)} each"
    )
    print("| method | peak per device | fits | largest terms | TFLOPs |" + (" max G |" if best_g else ""))
    print("|---|---|---|---|---|" + ("---|" if best_g else ""))
    for p in plans:
        terms = ", ".join(f"{name} {_gib(size)}" for name, size in p.memory.largest())
        fits = {True: "yes", False: "no", None: "?"}[p.fits]
        extra = f" {best_g[p.memory.method]} |" if best_g else ""
        tflops = p.flops.total / 1e12
        print(f"| {p.memory.method} | {_gib(p.memory.peak_bytes)} | {fits} | {terms} | {tflops:.1f} |{extra}")
    token_floor = workload.shared_tokens / workload.dense_tokens
    print(f"token floor {token_floor:.3f}; FLOP floor {flop_floor(dims, workload) / 1e12:.1f} TFLOPs (forward)")
    print(_settings(dims, workload, engine))
    return 0


def real_token_counts(args: argparse.Namespace) -> tuple[int | None, int | None]:
    """(real prompt tokens of the B prompts, real completion tokens of the B x G rows) from ``--prompt-tokens`` /
    ``--mean-prompt-len`` and ``--completion-tokens`` / ``--mean-completion-len`` (None where neither is given)."""

    def total(count, mean, per, count_option, mean_option):
        if count is not None and mean is not None:
            raise ValueError(f"{count_option}: give {count_option} or {mean_option}, not both")
        if mean is None:
            return count
        if not mean > 0:
            raise ValueError(f"{mean_option}: must be positive, got {mean}")
        return round(mean * per)

    rows = args.prompts * args.generations
    prompts = total(args.prompt_tokens, args.mean_prompt_len, args.prompts, "--prompt-tokens", "--mean-prompt-len")
    completions = total(
        args.completion_tokens, args.mean_completion_len, rows, "--completion-tokens", "--mean-completion-len"
    )
    return prompts, completions


_OPTION_OF = {
    "prompts": "--prompts",
    "prompt_tokens": "--prompt-tokens",
    "scored_tokens": "--completion-tokens",
    "prompt_len": "--prompt-len",
    "completion_len": "--completion-len",
    "generations": "--generations",
    "workload": "--workload",
    "dtype": "--dtype",
    "optimizer": "--optimizer",
    "gpus": "--gpus",
    "engine": "--engine",
    "device": "--device",
    "lora_fraction": "--lora-fraction",
    "layers": "--layers",
    "generations_per_chunk": "--generations-per-chunk",
    "preset": "--model",
    "config": "--model",
    "model": "--model",
    "unknown preset": "--model",
    "gpu_memory": "--gpu-memory",
    "head_implementation": "--head-implementation",
    "token_budget": "--token-budget",
    "repeats_kv": "--sdpa-repeats-kv",
}


def _with_option(error: Exception) -> str:
    """The error's message, led by the command-line option it is about."""
    text = str(error)
    if text.startswith("--"):
        return text
    # Longest names first: generations_per_chunk before generations.
    for name, option in sorted(_OPTION_OF.items(), key=lambda item: -len(item[0])):
        if text.startswith((name + " ", f"unknown {name}", name)):
            return f"{option}: {text}"
    return text


def _settings(dims, workload: Workload, engine: Engine) -> str:
    """``chunked_backward``'s largest power-of-two ``generations_per_chunk`` that fits (the fewest backward passes),
    or what to change when none does."""
    from .memory import plan_memory

    if not workload.train:
        from ..engine.budget import DEFAULT_TOKEN_BUDGET

        if workload.token_budget is None:
            return f"settings: no-grad scoring batches within token_budget={DEFAULT_TOKEN_BUDGET} (the default)"
        return f"settings: no-grad scoring batches within token_budget={workload.token_budget}"
    if engine.memory_bytes is None:
        return f"settings: chunked_backward(generations_per_chunk={workload.chunk_generations})"
    chunk, best = 1, None
    while chunk <= workload.generations:
        need = plan_memory("chunked", dims, workload.with_chunk(chunk), engine).peak_bytes
        if need > engine.memory_bytes:
            break
        best, chunk = chunk, chunk * 2
    if best is not None:
        return f"settings: chunked_backward(generations_per_chunk={best}) fits"
    options = ["more GPUs", "LoRA (--lora-fraction)", "fewer prompts per device"]
    if not workload.gradient_checkpointing:
        options.insert(0, "--gradient-checkpointing")
    return "settings: chunked_backward does not fit even with generations_per_chunk=1; try " + ", ".join(options)
