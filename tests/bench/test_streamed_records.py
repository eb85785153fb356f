"""The bench CLI and the tree bench append each record to ``<output>/<name>.jsonl`` as soon as it is measured, so a
run stopped midway (a step's timeout, an out-of-memory kill: here a KeyboardInterrupt raised inside a later method's
run) leaves every record measured until then; a run that finishes leaves every record there too."""

from __future__ import annotations

import json

import pytest
import torch

from shared_prefix_logps.bench import methods, tree_methods
from shared_prefix_logps.bench.report import read_records
from shared_prefix_logps.cli import main

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BENCH = ["bench", "--device", "cpu", "--preset", "tiny", "--layers", "1", "--repeats", "1"]
SHAPE = [
    "--prompts",
    "2",
    "--prompt-len",
    "16",
    "--completion-len",
    "4",
    "--generations",
    "2",
    "4",
    "--workloads",
    "score",
]


def _interrupted_on_call(step, call: int):
    """``step``, raising KeyboardInterrupt (not caught as a method's failure) on its ``call``-th call."""
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise KeyboardInterrupt("stopped at its timeout")
        return step(*args, **kwargs)

    return interrupted


def test_bench_records_are_on_disk_before_the_run_is_stopped(tmp_path, monkeypatch):
    # Per cell: warm-up, one timed round, then the peak run per method. The third call of the last method (its peak
    # run on the first cell) is interrupted: dense's and expand's records of that cell are final by then.
    step, available = methods.METHODS["dense"]
    monkeypatch.setitem(methods.METHODS, "last", (_interrupted_on_call(step, 3), available))
    with pytest.raises(KeyboardInterrupt):
        main([*BENCH, *SHAPE, "--methods", "dense,expand,last", "--output", str(tmp_path), "--name", "run"])
    assert not (tmp_path / "run.json").exists()  # the full results file is written at the end only
    records = read_records(tmp_path / "run.jsonl")
    assert [(r["method"], r["generations"], r["status"]) for r in records] == [("dense", 2, "ok"), ("expand", 2, "ok")]
    assert all(r["median_ms"] > 0 and r["workload"] == "score" and r["run_started"] for r in records)


def test_a_finished_bench_streams_every_record_of_its_results_file(tmp_path):
    code = main([*BENCH, *SHAPE, "--methods", "dense,expand", "--output", str(tmp_path), "--name", "run"])
    assert code == 0
    final = json.loads((tmp_path / "run.json").read_text())["records"]
    streamed = read_records(tmp_path / "run.jsonl")
    assert len(streamed) == len(final) == 4
    key = lambda r: (r["method"], r["generations"])  # noqa: E731
    assert sorted(map(key, streamed)) == sorted(map(key, final))
    assert {r["run_started"] for r in streamed} == {streamed[0]["run_started"]}
    for record in final:
        (same,) = [r for r in streamed if key(r) == key(record)]
        assert {k: v for k, v in same.items() if k != "run_started"} == record


def test_tree_bench_records_are_on_disk_before_the_run_is_stopped(tmp_path, monkeypatch):
    # The score cell completes (its records are final after its timed round); tree's first train run is
    # interrupted: the score records are on disk, nothing of the train cell.
    step = tree_methods.TREE_METHODS["tree"]

    def interrupted_in_train(model, case, train):
        if train:
            raise KeyboardInterrupt("stopped at its timeout")
        return step(model, case, train)

    monkeypatch.setitem(tree_methods.TREE_METHODS, "tree", interrupted_in_train)
    options = ["prompts=2", "system=12", "task=3", "generations=2", "completion=4", "tool_length=2"]
    args = [*BENCH, "--tree-workload", "agentic", "--methods", "dense,tree", "--workloads", "score,train"]
    args += [a for option in options for a in ("--tree-option", option)]
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--output", str(tmp_path), "--name", "tree"])
    records = read_records(tmp_path / "tree.jsonl")
    assert [(r["method"], r["workload"], r["status"]) for r in records] == [
        ("dense", "score", "ok"),
        ("tree", "score", "ok"),
    ]
    assert all(r["median_ms"] > 0 and r["load_average"] is not None for r in records)
    assert torch.isfinite(torch.tensor([r["speedup"] for r in records])).all()
