"""Tables, JSON and plots of benchmark records."""

from __future__ import annotations

import json
from pathlib import Path


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def markdown_table(records: list[dict]) -> str:
    """One row per record: shape, method, status, time, peak memory, speed-up and memory vs dense."""
    dense = {
        (r["workload"], r["prompts"], r["prompt_len"], r["completion_len"], r["generations"]): r
        for r in records
        if r["method"] == "dense" and r["status"] == "ok"
    }
    lines = [
        "| workload | B | P | C | G | method | status | median ms | peak MiB | x dense time | x dense memory | "
        "token floor | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        key = (r["workload"], r["prompts"], r["prompt_len"], r["completion_len"], r["generations"])
        ref = dense.get(key)
        ok = r["status"] == "ok"
        speed = f"{ref['median_ms'] / r['median_ms']:.2f}" if ok and ref else "-"
        memory = (
            f"{r['peak_bytes'] / ref['peak_bytes']:.3f}"
            if ok and ref and r.get("peak_bytes") is not None and ref.get("peak_bytes")
            else "-"
        )
        diff = r.get("max_abs_diff_vs_dense")
        status = r["status"] if r["status"] != "skipped" else f"skipped ({r['reason']})"
        lines.append(
            f"| {r['workload']} | {r['prompts']} | {r['prompt_len']} | {r['completion_len']} | {r['generations']} "
            f"| {r['method']} | {status} | {r['median_ms']:.1f} | {_mib(r.get('peak_bytes'))} | {speed} | {memory} | "
            f"{r['token_floor']:.3f} | {'-' if diff is None else f'{diff:.2e}'} |"
            if ok
            else f"| {r['workload']} | {r['prompts']} | {r['prompt_len']} | {r['completion_len']} | "
            f"{r['generations']} | {r['method']} | {status} | - | - | - | - | {r['token_floor']:.3f} | - |"
        )
    return "\n".join(lines)


def write_json(records: list[dict], path: Path, meta: dict) -> None:
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=1))


def write_plots(records: list[dict], directory: Path, prefix: str = "") -> list[Path]:
    """Peak memory vs G (at the largest P) and time vs P (at the largest G), one line per method, a panel per
    workload; returns the files written (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    ok = [r for r in records if r["status"] == "ok"]
    written = []
    for x, fixed, y, name, ylabel in (
        ("generations", "prompt_len", "peak_bytes", "memory_vs_g.png", "peak memory (MiB)"),
        ("prompt_len", "generations", "median_ms", "time_vs_p.png", "median step time (ms)"),
    ):
        if not ok:
            break
        # One curve per method: the other swept axis is held at its largest value.
        at = max(r[fixed] for r in ok)
        rows = [r for r in ok if r[fixed] == at and r["completion_len"] == ok[0]["completion_len"]]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4), squeeze=False)
        for ax, workload in zip(axes[0], ("score", "train")):
            for method in sorted({r["method"] for r in ok}):
                points = sorted(
                    (r[x], r[y] / (2**20 if y == "peak_bytes" else 1))
                    for r in rows
                    if r["method"] == method and r["workload"] == workload and r.get(y) is not None
                )
                if points:
                    ax.plot(*zip(*points), marker="o", label=method)
            ax.set_title(f"{workload} ({fixed} = {at})")
            ax.set_xlabel(x)
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
        fig.tight_layout()
        path = directory / f"{prefix}{name}"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
