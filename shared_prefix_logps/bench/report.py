"""Tables, JSON and plots of benchmark records."""

from __future__ import annotations

import json
from pathlib import Path

#: How far beyond the FLOP bound a measured speed-up may land before it is flagged: timing noise on a loaded CPU.
FLOP_BOUND_TOLERANCE = 0.1


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def _key(record: dict) -> tuple:
    return tuple(record[k] for k in ("workload", "prompts", "prompt_len", "completion_len", "generations"))


def speedups_over_dense(records: list[dict]) -> list[float | None]:
    """Per record, dense's median time over its own on the same cell; None where either is not ok."""
    dense = {_key(r): r for r in records if r["method"] == "dense" and r["status"] == "ok"}
    return [
        dense[_key(r)]["median_ms"] / r["median_ms"] if r["status"] == "ok" and _key(r) in dense else None
        for r in records
    ]


def beyond_flop_bound(records: list[dict], tolerance: float = FLOP_BOUND_TOLERANCE) -> list[dict]:
    """The records faster than dense by more than ``(1 + tolerance) / flop_floor``: at equal efficiency no method
    can be, so each one means dense did work the floors do not count (pads, masked attention) or timing noise."""
    return [
        r
        for r, speedup in zip(records, speedups_over_dense(records))
        if speedup is not None and speedup * r["flop_floor"] > 1 + tolerance
    ]


def markdown_table(records: list[dict]) -> str:
    """One row per record: shape, method, status, time, peak memory, speed-up and memory vs dense, both floors, the
    share of the FLOP bound the speed-up reaches (speed-up x FLOP floor; 1.00 = as fast as the floor allows) and the
    largest log-prob difference from dense."""
    dense = {_key(r): r for r in records if r["method"] == "dense" and r["status"] == "ok"}
    lines = [
        "| workload | B | P | C | G | method | status | median ms | peak MiB | x dense time | x dense memory | "
        "token floor | FLOP floor | of FLOP bound | max abs diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r, speedup in zip(records, speedups_over_dense(records)):
        ref = dense.get(_key(r))
        shape = f"| {r['workload']} | {r['prompts']} | {r['prompt_len']} | {r['completion_len']} | {r['generations']} "
        floors = f"{r['token_floor']:.3f} | {r['flop_floor']:.3f}"
        if r["status"] != "ok":
            status = r["status"] if r["status"] != "skipped" else f"skipped ({r['reason']})"
            lines.append(f"{shape}| {r['method']} | {status} | - | - | - | - | {floors} | - | - |")
            continue
        memory = (
            f"{r['peak_bytes'] / ref['peak_bytes']:.3f}"
            if ref and r.get("peak_bytes") is not None and ref.get("peak_bytes")
            else "-"
        )
        diff = r.get("max_abs_diff_vs_dense")
        times = "- | " if speedup is None else f"{speedup:.2f} | "
        share = "-" if speedup is None or r["method"] == "dense" else f"{speedup * r['flop_floor']:.2f}"
        lines.append(
            f"{shape}| {r['method']} | ok | {r['median_ms']:.1f} | {_mib(r.get('peak_bytes'))} | {times}{memory} | "
            f"{floors} | {share} | {'-' if diff is None else f'{diff:.2e}'} |"
        )
    return "\n".join(lines)


def write_json(records: list[dict], path: Path, meta: dict) -> None:
    """Write ``{"meta": meta, "records": records}`` to ``path``, the file ``tests/bench/test_results.py`` reads."""
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=1))


class RecordStream:
    """Appends each record to a JSON-lines file as one line when it is measured (``write``), flushed at once, so a
    run stopped midway (a timeout, an out-of-memory kill) leaves every record measured until then; the run's full
    results file is written at the end as before. Every line carries ``run_started`` (UTC, ISO 8601), which tells the
    runs appended to one file apart."""

    def __init__(self, path: Path):
        import datetime

        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")

    def write(self, record: dict) -> None:
        with self.path.open("a") as stream:
            stream.write(json.dumps({"run_started": self.started, **record}) + "\n")
            stream.flush()


def read_records(path: Path) -> list[dict]:
    """The records of a JSON-lines file written by :class:`RecordStream`, in the order they were measured."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_plots(records: list[dict], directory: Path, prefix: str = "") -> list[Path]:
    """Peak memory vs G (at the largest P) and time vs P (at the largest G), one line per method, a panel per
    workload in the records; returns the files written (none without matplotlib)."""
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
        workloads = [w for w in ("score", "train") if any(r["workload"] == w for r in ok)]
        fig, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
        for ax, workload in zip(axes[0], workloads):
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
