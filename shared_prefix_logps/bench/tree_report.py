"""Markdown of tree-benchmark records (:mod:`.tree_runner`): the full table, the report around it, and the short
table proposed for the README."""

from __future__ import annotations


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f}"


def _peers(records: list[dict]) -> dict[tuple, dict]:
    return {(r["workload"], r["method"]): r for r in records if r.get("status") == "ok"}


def markdown_table(records: list[dict]) -> str:
    """One row per record: method, tokens it forwards, its FLOPs, time, peak memory, speed-up over dense against the
    floor's, peak memory over two_level's, and the largest log-prob difference from dense."""
    peers = _peers(records)
    lines = [
        "| workload | method | status | tokens forwarded | TFLOP | median s | peak MiB | x dense time | floor x dense "
        "| of floor | peak / two_level | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        head = (
            f"| {r['workload']} | {r['method']} | {r.get('status')} | {r['tokens_forwarded']:,} "
            f"| {r['flops'] / 1e12:.2f} "
        )
        floor = f"{r['floor_speedup']:.2f}"
        if r.get("status") != "ok":
            lines.append(f"{head}| - | - | - | {floor} | - | - | - |")
            continue
        one = peers.get((r["workload"], "two_level"))
        memory = f"{r['peak_bytes'] / one['peak_bytes']:.2f}" if one and one.get("peak_bytes") else "-"
        speedup = "-" if r.get("speedup") is None else f"{r['speedup']:.2f}"
        share = "-" if r.get("of_floor") is None or r["method"] == "dense" else f"{r['of_floor']:.2f}"
        diff = r.get("max_abs_diff_vs_dense")
        lines.append(
            f"{head}| {r['median_ms'] / 1e3:.1f} | {_mib(r.get('peak_bytes'))} | {speedup} | {floor} | {share} | "
            f"{memory} | {'-' if diff is None else f'{diff:.1e}'} |"
        )
    return "\n".join(lines)


def shape_words(meta: dict) -> str:
    """The workload's shape in a few words, from its builder's keywords."""
    o = meta["tree_options"]
    name = meta["tree_workload"]
    if name == "agentic":
        words = (
            f"{o['prompts']} prompts: {o['system']}-token shared system + {o['task']} task tokens; G={o['generations']}"
            f" x {o['completion']} tokens, {o['tool_spans']} unscored tool spans of {o['tool_length']}"
        )
    elif name == "turns":
        words = (
            f"{o['conversations']} conversations x {o['num_turns']} turns ({o['system']} system, {o['user']} user, "
            f"{o['response']} response tokens a turn)"
        )
    else:
        words = (
            f"{o['prompts']} prompts of {o['prompt_length']}, {o['completions']} completions of {o['completion']} "
            "forking at random depths"
        )
    return words + ("" if meta["scale"] == "the preset's shapes" else f" ({meta['scale']})")


def markdown_report(meta: dict, records: list[dict]) -> str:
    """The results file: settings, how to read the table, the table."""
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
    load = meta.get("load_average") or {}
    return "\n".join(
        [
            f"# Tree benchmark: `{meta['tree_workload']}` on {meta['preset']} ({meta['layers']} layers), "
            f"{meta['device']}",
            "",
            f"Workload: {shape_words(meta)}.",
            "",
            f"dtype {meta['dtype']}; commit {meta['commit']}; {versions}; threads {meta['threads']}; load average "
            f"(1, 5, 15 min) before {load.get('before')}, after {load.get('after')}; timing {meta['timing']}.",
            "",
            "tokens forwarded: real tokens through the model body. TFLOP: model-config matmul FLOPs of the method's "
            "step (bench/tree_flops.py). floor x dense: dense's FLOPs over the floor's (every trie token once, the "
            "head on the distinct scored pairs), the most any method can be faster than dense at dense's efficiency. "
            "of "
            "floor: the measured speed-up over dense divided by the floor's. dense runs in micro-batches of rows "
            "(see micro_batches in the JSON); two_level and tree train as chunked backwards of chunk_rows rows, as "
            "many as fit in the dense micro-batch's tokens.",
            "",
            markdown_table(records),
            "",
        ]
    )


def readme_table(runs: list[tuple[dict, list[dict]]]) -> str:
    """A short table over several runs (``(meta, records)`` each): per workload preset and step, each method's time,
    the tree's speed-up over dense against the floor's, and the tree's peak memory over the two-level trie's."""
    meta0 = runs[0][0]
    threads = " or ".join(str(t) for t in sorted({meta["threads"] for meta, _ in runs}))
    threads += " thread" if threads == "1" else " threads"
    lines = [
        f"Measured on CPU ({meta0['device']}, {threads}, {meta0['dtype'].replace('torch.', '')}), "
        f"{meta0['preset']} dims with {meta0['layers']} layers; tree x dense: measured speed-up (the FLOP floor's):",
        "",
        "| workload | step | dense s | two-level s | tree s | tree x dense (floor) | tree peak / two-level |",
        "|---|---|---|---|---|---|---|",
    ]
    for meta, records in runs:
        peers = _peers(records)
        for step in ("score", "train"):
            dense, one, tree = (peers.get((step, m)) for m in ("dense", "two_level", "tree"))
            if tree is None:
                continue
            scale = "" if meta["scale"] == "the preset's shapes" else " (scaled)"
            seconds = [f"{r['median_ms'] / 1e3:.0f}" if r else "-" for r in (dense, one, tree)]
            speed = f"{tree['speedup']:.2f} ({tree['floor_speedup']:.2f})" if tree.get("speedup") else "-"
            memory = f"{tree['peak_bytes'] / one['peak_bytes']:.2f}" if one else "-"
            lines.append(f"| {meta['tree_workload']}{scale} | {step} | {' | '.join(seconds)} | {speed} | {memory} |")
    return "\n".join(lines)
