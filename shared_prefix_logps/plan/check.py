"""The plan's CPU predictions against what ``bench`` measures: a grid of configurations, one record each.

``python -m shared_prefix_logps.plan.check`` writes the grid at real widths (qwen2.5-0.5b's dims, 2 layers, a Qwen2
and a Llama model) as a Markdown table; the tests run the same at tiny widths.
"""

from __future__ import annotations

import argparse
import itertools
import sys

import torch

from .api import bench_workload, predicted_peak_bytes

#: Methods whose CPU peak can be measured (the live-bytes tracker cannot see inside flex_attention, whose backward
#: needs CUDA anyway).
MEASURABLE = ("dense", "trl", "expand", "chunked")


def build_model(config: dict, family: str) -> torch.nn.Module:
    """A randomly initialised float32 causal LM of ``family`` (``qwen2`` or ``llama``) from ``config``."""
    import transformers as tf

    config_cls, model_cls = {
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
    }[family]
    torch.manual_seed(0)
    model = model_cls(config_cls(**config))
    model.train(False)
    return model


def check_grid(
    config: dict, families, methods, *, prompts: int, prompt_lens, completion_len: int, generations, progress=None
) -> list[dict]:
    """Measured (``bench.runner.run_cell``, no timing repeats) and predicted CPU peak bytes of each method over
    the grid.

    Returns one record per (family, workload, G, P, method): the shape, ``measured``, ``predicted`` and
    ``error`` (predicted / measured - 1).
    """
    from ..bench.runner import Shape, run_cell

    records = []
    for family in families:
        model = build_model(config, family)
        family_config = {**config, "model_type": family}
        for workload, g, p in itertools.product(("score", "train"), generations, prompt_lens):
            shape = Shape(prompts, p, completion_len, g)
            w = bench_workload(prompts, p, completion_len, g, mode=workload, dtype="fp32")
            for run in run_cell(model, methods, shape, workload, repeats=0):
                method = run["method"]
                if run["status"] != "ok":
                    raise RuntimeError(f"{method} {workload} G={g} P={p}: {run.get('reason', run['status'])}")
                predicted = predicted_peak_bytes(method, family_config, w, device="cpu")
                records.append(
                    dict(
                        family=family,
                        workload=workload,
                        generations=g,
                        prompt_len=p,
                        method=method,
                        measured=run["peak_bytes"],
                        predicted=predicted,
                        error=predicted / run["peak_bytes"] - 1,
                    )
                )
                if progress is not None:
                    progress(records[-1])
        del model
    return records


def markdown(records: list[dict]) -> str:
    """The records as a Markdown table, MiB, with the worst error last."""
    lines = [
        "| family | workload | G | P | method | measured MiB | predicted MiB | error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['family']} | {r['workload']} | {r['generations']} | {r['prompt_len']} | {r['method']} | "
            f"{r['measured'] / 2**20:.1f} | {r['predicted'] / 2**20:.1f} | {r['error']:+.1%} |"
        )
    worst = max(records, key=lambda r: abs(r["error"]))
    lines.append("")
    lines.append(
        f"Worst error over {len(records)} measurements: {worst['error']:+.1%} ({worst['method']} {worst['family']} "
        f"{worst['workload']} G={worst['generations']} P={worst['prompt_len']})."
    )
    return "\n".join(lines)


def main(argv=None) -> None:
    """Run the grid at real widths (qwen2.5-0.5b dims, 2 layers) and print the Markdown table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--methods", default="dense,expand,chunked")
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--completion-len", type=int, default=32)
    parser.add_argument("--generations", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--families", default="qwen2,llama")
    args = parser.parse_args(argv)
    from .dims import dims_from_preset

    d = dims_from_preset("qwen2.5-0.5b")
    config = dict(
        hidden_size=d.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        head_dim=d.head_dim,
        intermediate_size=d.intermediate,
        vocab_size=d.vocab,
        tie_word_embeddings=d.tied,
        max_position_embeddings=4096,
    )
    records = check_grid(
        config,
        args.families.split(","),
        args.methods.split(","),
        prompts=args.prompts,
        prompt_lens=args.prompt_len,
        completion_len=args.completion_len,
        generations=args.generations,
        progress=lambda record: print(record, file=sys.stderr, flush=True),
    )
    print(markdown(records))


if __name__ == "__main__":
    main()
