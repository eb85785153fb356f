"""Tokens forwarded and time of verl's FSDP engine with and without the verl plug-in, on a verl-shaped batch.

The batch is what verl's trainer hands ``compute_log_prob`` and ``update_actor``: ``prompts`` prompts (left-padded,
lengths up to ``--prompt-len``) with ``rollout.n = --responses`` responses each (right-padded, up to
``--response-len``), consecutive, in verl's no-padding layout; micro-batches of ``--micro-batch`` rows (or
``--max-token-len`` tokens with dynamic batch size). For each engine it runs the old-log-prob pass (``infer_batch``,
entropy on) and one ``update_actor`` micro-batch loop (``forward_backward_batch`` with verl's ``ppo_loss``) and
records the token ids the model's embedding received (padding included), the real tokens (each prompt counted
once per micro-batch by the patched engine), the median time, and the max |difference| of the log-probs from the
unpatched engine. Runs on CPU with a random model built from a config (nothing downloaded), one process:

    .venv-verl/bin/python benchmarks/bench_verl.py --prompts 4 --responses 8 --prompt-len 512 --response-len 64

Needs verl (``make test-verl`` builds ``.venv-verl``). The numbers of tokens do not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from support import verl_setup as vs  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--responses", type=int, default=8, help="rollout.n")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=8, help="rows per micro-batch (log_prob/ppo micro batch)")
    parser.add_argument("--max-token-len", type=int, default=0, help="> 0: dynamic batch size with this token budget")
    parser.add_argument("--family", default="qwen2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None, help="write the records as JSON here")
    return parser.parse_args(argv)


def measure(engine, make_batch, step, repeats):
    """Median seconds of ``step(engine, batch)``, the token ids embedded per call, and the last result."""
    times, tokens, result = [], 0, None
    for _ in range(repeats):
        td = make_batch(engine)
        counter = vs.TokenCounter(engine)
        start = time.perf_counter()
        try:
            result = step(engine, td)
        finally:
            counter.close()
        times.append(time.perf_counter() - start)
        tokens = counter.tokens
    return statistics.median(times), tokens, result


def infer(engine, td):
    with engine.eval_mode():
        return engine.infer_batch(td)


def update(loss_fn):
    def step(engine, td):
        with engine.train_mode():
            return engine.forward_backward_batch(td, loss_function=loss_fn, forward_only=False)

    return step


def run(args) -> list[dict]:
    from verl.workers.utils.padding import no_padding_2_padding

    from shared_prefix_logps.integrations.verl import get_patch, patch_verl_engine, unpatch_verl_engine

    torch.set_num_threads(args.threads)
    vs.use_cpu_platform()
    from support.distributed import free_port

    vs.init_single_process(free_port())
    path = vs.save_model(tempfile.mkdtemp(prefix="bench_verl_"), args.family)
    dynamic = args.max_token_len > 0
    options = dict(micro_batch_size=args.micro_batch, dynamic_bsz=dynamic, max_token_len=args.max_token_len or 64)
    patched, unpatched = vs.build_engine(path, **options), vs.build_engine(path, **options)
    unpatch_verl_engine(unpatched)
    unpatch_verl_engine(patched)
    patch = patch_verl_engine(patched, self_check=False)  # timings without the one-off comparison
    shape = dict(
        num_prompts=args.prompts,
        generations=args.responses,
        prompt_len=args.prompt_len,
        response_len=args.response_len,
        seed=0,
    )

    def batch(infer_pass):
        def make(engine):
            td = vs.batch_options(engine, vs.rollout_batch(**shape), infer=infer_pass)
            # training keeps the log-probs only when asked (verl drops them to save memory)
            return td if infer_pass else vs.assign(td, return_model_output=True)

        return make

    loss_fn = vs.ppo_loss(entropy_coeff=0.01, use_kl_loss=True)
    records, logps = [], {}
    for workload, make, step in (("old_log_prob", batch(True), infer), ("update_actor", batch(False), update(loss_fn))):
        for name, engine in (("verl", unpatched), ("shared_prefix", patched)):
            before = (patch.stats.tokens_forwarded, patch.stats.dense_tokens)
            seconds, embedded, result = measure(engine, make, step, args.repeats)
            td = make(engine)
            logps[name] = no_padding_2_padding(result["model_output"]["log_probs"], td)
            record = dict(
                workload=workload,
                engine=name,
                rows=args.prompts * args.responses,
                prompt_len=args.prompt_len,
                response_len=args.response_len,
                micro_batch=args.micro_batch,
                dynamic_bsz=dynamic,
                embedded_tokens=embedded,
                median_s=seconds,
            )
            if engine is patched:
                real = patch.stats.tokens_forwarded - before[0]
                dense = patch.stats.dense_tokens - before[1]
                record.update(real_tokens=real // args.repeats, dense_real_tokens=dense // args.repeats)
                record["max_abs_diff_vs_verl"] = float((logps["shared_prefix"] - logps["verl"]).abs().max())
            records.append(record)
    assert get_patch(patched).stats.fallback_calls == 0
    return records


def table(records) -> str:
    lines = [
        "| workload | engine | embedded tokens | real tokens | median s | max abs diff |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        real = r.get("real_tokens", "")
        real = f"{real} of {r['dense_real_tokens']}" if real != "" else ""
        diff = f"{r['max_abs_diff_vs_verl']:.1e}" if "max_abs_diff_vs_verl" in r else ""
        lines.append(
            f"| {r['workload']} | {r['engine']} | {r['embedded_tokens']} | {real} | {r['median_s']:.3f} | {diff} |"
        )
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    records = run(args)
    print(table(records))
    if args.output is not None:
        args.output.write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    main()
