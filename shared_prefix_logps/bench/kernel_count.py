"""``shared-prefix-logps bench --count-kernels``: what each method's step would cost a GPU's host, counted on CPU.

A step on a GPU costs its kernels' time and its host's: every kernel launch is some 10-30 us of Python and dispatch,
every host sync drains the device's queue. Both are counted on CPU (:mod:`.dispatch_count`) on a model with a preset's
real structure (layers, heads, grouped KV heads) and narrow widths (head dimension 16, vocabulary 1024), where a step
takes a second: the counts depend on the structure, not on the widths or the lengths. Methods run on the same rows:

- ``dense``: the benchmark's dense step (every row through the model's own forward);
- ``expand``, ``flex``: ``compute_logps`` with that layout (scoring: no-grad; training: with the backward of the
  summed log-probs); ``flex`` is the layout whose calls hold every depth: a plan of one chunk is one model call;
- ``chunked-flex``, ``chunked-expand``: ``chunked_backward`` (training) with that layout and its default chunking,
  and ``chunked-flex/1``, ``chunked-expand/1`` with one generation per chunk (forced chunks);
- ``tree-dense``, ``tree-expand``, ``tree-flex``: ``compute_logps_tree`` on a trie of depth 3 (a system prompt, the
  prompts, their completions) with the dense reference or a layout.

For each: kernels (and their ratio to the dense step of the same rows), node calls and kernels per node call over
dense's, host syncs with their call sites, and gradient additions (pointwise additions into a parameter's ``.grad``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .. import chunked_backward, compute_logps, compute_logps_tree
from .dispatch_count import Counts, count_step
from .methods import METHODS, Batch

#: Head dimension, vocabulary and MLP width factor of the narrowed models.
NARROW_HEAD_DIM, NARROW_VOCAB, NARROW_MLP = 16, 1024, 2

#: G of the scoring and of the training step when ``--generations`` is not given (the GPU runs' shapes), and the
#: lengths (the counts do not depend on them).
COUNT_GENERATIONS = (16, 4)
COUNT_PROMPT_LEN, COUNT_COMPLETION_LEN = 64, 16

#: The methods counted by default: (name, steps it runs).
COUNTED = (
    ("dense", ("score", "train")),
    ("expand", ("score", "train")),
    ("flex", ("score", "train")),
    ("chunked-flex", ("train",)),
    ("chunked-flex/1", ("train",)),
    ("chunked-expand/1", ("train",)),
    ("tree-dense", ("score",)),
    ("tree-expand", ("score",)),
    ("tree-flex", ("score",)),
)


def narrow_config(preset: str, *, layers: int | None = None):
    """The config of ``preset`` with its structure (layers, heads, KV heads, layer pattern) and narrow widths."""
    from .presets import preset_config

    config = preset_config(preset, layers=layers)
    heads = config.num_attention_heads
    config.hidden_size = heads * NARROW_HEAD_DIM
    config.head_dim = NARROW_HEAD_DIM
    config.intermediate_size = NARROW_MLP * config.hidden_size
    config.vocab_size = NARROW_VOCAB
    for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(config, name, None):
            setattr(config, name, NARROW_MLP * config.hidden_size)
    for name in ("linear_key_head_dim", "linear_value_head_dim"):
        if getattr(config, name, None):
            setattr(config, name, NARROW_HEAD_DIM)
    return config


def narrow_model(preset: str, *, layers: int | None = None, seed: int = 0):
    """A float32 causal LM of :func:`narrow_config` with random weights, on the CPU."""
    import transformers

    config = narrow_config(preset, layers=layers)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).float()


def grouped_batch(prompts: int, generations: int, prompt_len: int, completion_len: int, seed: int = 1) -> Batch:
    """Unpadded prompts of ``prompt_len`` and completions of ``completion_len / 2 .. completion_len`` real tokens."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, NARROW_VOCAB, (prompts, prompt_len), generator=gen)
    completions = torch.randint(1, NARROW_VOCAB, (prompts * generations, completion_len), generator=gen)
    lengths = torch.randint(completion_len // 2, completion_len + 1, (prompts * generations,), generator=gen)
    completion_mask = torch.arange(completion_len)[None] < lengths[:, None]
    return Batch(ids, torch.ones_like(ids, dtype=torch.bool), completions, completion_mask)


def tree_rows(batch: Batch, system_len: int = 32):
    """(ids, attention mask, score mask) of a trie of depth 3: ``batch``'s rows behind one shared system prompt."""
    ids, mask = batch.rows()
    system = torch.randint(1, NARROW_VOCAB, (1, system_len), generator=torch.Generator().manual_seed(7))
    ids = torch.cat([system.expand(ids.shape[0], -1), ids], 1)
    mask = torch.cat([torch.ones(ids.shape[0], system_len, dtype=torch.bool), mask], 1)
    score = mask.clone()
    score[:, : ids.shape[1] - batch.completions.shape[1]] = False
    return ids, mask, score


def _step(name: str, train: bool, batch: Batch):
    """The callable that runs ``name``'s step on ``batch`` (its result is dropped), and the step's input tensors (on
    the device in a real step)."""
    kwargs = dict(prompt_mask=batch.prompt_mask, completion_mask=batch.completion_mask)
    inputs = [batch.prompts, batch.prompt_mask, batch.completions, batch.completion_mask]

    def total(out, rows):
        return out.logps.sum()

    if name in ("dense", "expand", "flex"):
        step = METHODS[name][0] if name == "dense" else None

        def run(model):
            if step is not None:
                return step(model, batch, train)
            with torch.set_grad_enabled(train):
                out = compute_logps(model, batch.prompts, batch.completions, backend=name, **kwargs)
                if train:
                    out.logps.sum().backward()

        return run, inputs
    if name.startswith("chunked-"):
        layout, _, forced = name[len("chunked-") :].partition("/")
        per_chunk = int(forced) if forced else "auto"
        return (
            lambda model: chunked_backward(
                model,
                batch.prompts,
                batch.completions,
                total,
                generations_per_chunk=per_chunk,
                backend=layout,
                **kwargs,
            ),
            inputs,
        )
    backend = name.split("-", 1)[1]
    rows = tree_rows(batch)

    def tree(model):
        with torch.set_grad_enabled(train):
            out = compute_logps_tree(model, *rows, backend=backend)
            if train:
                out.logps.sum().backward()

    return tree, list(rows)


@dataclass
class Counted:
    """One method's step: its counts and its node calls."""

    method: str
    step: str
    counts: Counts
    node_calls: int


@contextlib.contextmanager
def _counting_node_calls(found: list):
    from ..engine import walk

    original = walk.forward_call

    def counted(*args, **kwargs):
        found.append(1)
        return original(*args, **kwargs)

    walk.forward_call = counted
    try:
        yield
    finally:
        walk.forward_call = original


def count_method(model, name: str, step: str, batch: Batch) -> Counted:
    """Count one step of ``name`` on ``batch`` (run once before, so one-time work, the model's preparation and its
    head check, is not counted)."""
    run, inputs = _step(name, step == "train", batch)
    model.zero_grad(set_to_none=True)
    run(model)
    model.zero_grad(set_to_none=True)
    calls: list = []
    with _counting_node_calls(calls):
        counts = count_step(lambda: run(model), model, inputs)
    model.zero_grad(set_to_none=True)
    return Counted(name, step, counts, len(calls))


def count_methods(model, batches: dict[str, Batch], methods=COUNTED, progress=None) -> list[dict]:
    """Records of every (method, step) of ``methods`` on ``batches[step]`` (the rows of each step; a tree method runs on
    the score rows), with ratios to the dense step of the same rows (``tree-dense`` for the tree methods)."""
    counted = {}
    for name, steps in methods:
        for step in steps:
            counted[(name, step)] = count_method(model, name, step, batches[step])
            if progress is not None:
                progress(f"{name} {step}")
    records = []
    for (name, step), entry in counted.items():
        dense = counted.get(("tree-dense" if name.startswith("tree-") else "dense", step))
        dense_kernels = dense.counts.num_kernels if dense is not None else None
        kernels = entry.counts.num_kernels
        records.append(
            {
                "method": name,
                "step": step,
                "kernels": kernels,
                "x_dense": kernels / dense_kernels if dense_kernels else None,
                "node_calls": entry.node_calls if "dense" not in name else None,
                "x_dense_per_call": kernels / entry.node_calls / dense_kernels
                if dense_kernels and entry.node_calls and "dense" not in name
                else None,
                "host_syncs": entry.counts.num_syncs,
                "sync_sites": dict(entry.counts.syncs),
                "grad_additions": entry.counts.grad_additions,
                "host_ops": sum(entry.counts.host_ops.values()),
            }
        )
    return records


def table(records: list[dict]) -> str:
    """The records as a Markdown table, then each method's host syncs by call site."""
    lines = [
        "| method | step | kernels | x dense | node calls | x dense per call | host syncs | grad additions |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        ratio = "" if r["x_dense"] is None else f"{r['x_dense']:.2f}"
        per_call = "" if r["x_dense_per_call"] is None else f"{r['x_dense_per_call']:.2f}"
        calls = "-" if r["node_calls"] is None else r["node_calls"]
        lines.append(
            f"| {r['method']} | {r['step']} | {r['kernels']} | {ratio} | {calls} | {per_call} | "
            f"{r['host_syncs']} | {r['grad_additions']} |"
        )
    lines.append("")
    for r in records:
        if r["sync_sites"]:
            sites = "; ".join(f"{site} x{n}" for site, n in sorted(r["sync_sites"].items()))
            lines.append(f"- {r['method']} {r['step']}: {sites}")
    return "\n".join(lines)


def run_count(args) -> int:
    """The ``--count-kernels`` run of the ``bench`` subcommand: the table on stdout (and JSON in ``--output``)."""
    import json
    from pathlib import Path

    from .run_info import device_name, git_commit, package_versions, progress_bar, set_cpu_threads

    set_cpu_threads(args.threads, torch.device("cpu"))
    preset = args.model or "qwen2.5-1.5b"
    model = narrow_model(preset, layers=args.layers)
    prompt_len = args.prompt_len[0] if args.prompt_len else COUNT_PROMPT_LEN
    completion_len = args.completion_len[0] if args.completion_len else COUNT_COMPLETION_LEN
    generations = args.generations or list(COUNT_GENERATIONS)
    score_g, train_g = generations[0], generations[-1]
    batches = {
        "score": grouped_batch(args.prompts, score_g, prompt_len, completion_len),
        "train": grouped_batch(args.prompts, train_g, prompt_len, completion_len),
    }
    bar = progress_bar(sum(len(steps) for _, steps in COUNTED))
    records = count_methods(model, batches, progress=bar)
    layers = model.config.num_hidden_layers
    heading = (
        f"{preset}: {layers} layers, widths narrowed (head dim {NARROW_HEAD_DIM}); {args.prompts} prompts of "
        f"{prompt_len} tokens, completions of up to {completion_len}; score G={score_g}, train G={train_g}"
    )
    print(heading)
    print(table(records))
    if args.output:
        out = Path(args.output)
        out.mkdir(parents=True, exist_ok=True)
        stem = args.name or "kernel-count"
        # ``count`` marks these records apart from the timed runs' (tests/bench/test_results.py reads those).
        meta = {"count": "kernels", "preset": preset, "layers": layers, "prompts": args.prompts}
        meta.update({"prompt_len": prompt_len, "completion_len": completion_len})
        meta.update({"score_generations": score_g, "train_generations": train_g})
        meta.update({"device": device_name(torch.device("cpu")), "versions": package_versions()})
        meta["commit"] = git_commit()
        (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        versions = ", ".join(f"{name} {version}" for name, version in meta["versions"].items())
        (out / f"{stem}.md").write_text(
            f"# Kernel count: {preset}\n\n{heading}\n\ncommit {meta['commit']}; {versions}\n\n{table(records)}\n"
        )
        print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")
    return 0
