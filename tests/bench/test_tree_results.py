"""The committed tree-benchmark results hold what the tree runner promises: token counts and FLOPs rebuilt from the
workload, no speed-up over dense beyond the floor's (plus timing noise), and on the ``agentic`` preset at real
widths the agentic criterion: the tree reaches 0.8 of the floor's speed-up, within the two-level trie's peak memory."""

import json
from pathlib import Path

import pytest

from shared_prefix_logps.bench.flops import ModelShape
from shared_prefix_logps.bench.presets import preset_config
from shared_prefix_logps.bench.tree_flops import method_flops
from shared_prefix_logps.bench.tree_runner import FLOOR_TOLERANCE, build_workload, flagged_beyond_floor
from shared_prefix_logps.bench.tree_workloads import forwarded_tokens

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
FILES = sorted(RESULTS.glob("*-cpu-tree-*.json"))


#: The two-level trie's method was recorded as ``one_level`` before it took the library's word for it.
_RENAMED = {"one_level": "two_level"}


def _load(path):
    """(meta, records) of a committed results file, method names and their per-method fields under today's names."""
    data = json.loads(path.read_text())
    records = []
    for record in data["records"]:
        renamed = {}
        for key, value in record.items():
            for old, new in _RENAMED.items():
                key = key.replace(old, new)
            renamed[key] = _RENAMED.get(value, value) if key == "method" else value
        records.append(renamed)
    return data["meta"], records


def test_there_are_committed_tree_runs():
    assert any(
        _load(p)[0]["tree_workload"] == "agentic" and _load(p)[0]["scale"] == "the preset's shapes" for p in FILES
    )


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_counts_and_flops_rebuilt_from_the_workload(path):
    meta, records = _load(path)
    options = dict(meta["tree_options"])
    config = preset_config(meta["preset"], layers=meta["layers"])
    workload, kwargs = build_workload(meta["tree_workload"], options, options.pop("vocab"))
    assert kwargs == meta["tree_options"]
    counts = forwarded_tokens(workload)
    shape = ModelShape.from_config(config)
    for record in records:
        flops = method_flops(shape, workload, train=record["workload"] == "train")
        for name in ("dense", "two_level", "tree", "unique"):
            assert record[f"tokens_{name}"] == counts[name], (name, record)
            assert record[f"flops_{name}"] == flops[name].total
        assert record["tokens_forwarded"] == counts[record["method"]]
        assert record["flops"] == flops[record["method"]].total
        assert record["floor_speedup"] == pytest.approx(flops["dense"].total / flops["unique"].total)
        assert record["scored_tokens"] == int(workload.score_mask.sum())
        if record["status"] == "ok" and record["method"] in ("dense", "tree"):
            assert record["tokens_embedded"] == counts[record["method"]], record


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_every_method_ran_and_agrees_with_dense(path):
    _, records = _load(path)
    for record in records:
        assert record["status"] == "ok", record
        if record["method"] != "dense":
            assert record["max_abs_diff_vs_dense"] < 1e-3, record


#: Runs whose timings do not compare methods (file name -> why), e.g. when the machine's load changed between their
#: one timed run per method; their speed-up checks are expected to fail. None of the committed runs is one.
UNCOMPARABLE_TIMES: dict[str, str] = {}


def _times_compare(path):
    reason = UNCOMPARABLE_TIMES.get(path.name)
    if reason:
        pytest.xfail(reason)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_speedup_beyond_the_floor(path):
    _times_compare(path)
    _, records = _load(path)
    assert all(r["speedup"] <= (1 + FLOOR_TOLERANCE) * r["floor_speedup"] for r in records)
    assert not flagged_beyond_floor(records)


def test_the_floor_check_flags_a_speedup_beyond_it():
    records = [dict(method="tree", speedup=2.3, floor_speedup=2.0), dict(method="x", speedup=2.1, floor_speedup=2.0)]
    assert flagged_beyond_floor(records) == records[:1]


def test_agentic_at_real_widths_meets_the_criterion():
    runs = [_load(p) for p in FILES]
    (records,) = [
        r for meta, r in runs if meta["tree_workload"] == "agentic" and meta["scale"] == "the preset's shapes"
    ]
    meta = next(m for m, _ in runs if m["tree_workload"] == "agentic" and m["scale"] == "the preset's shapes")
    assert meta["preset"] == "qwen2.5-0.5b" and meta["layers"] == 2 and meta["dtype"] == "torch.float32"
    score = {r["method"]: r for r in records if r["workload"] == "score"}
    tree, two_level = score["tree"], score["two_level"]
    assert tree["peak_bytes"] <= two_level["peak_bytes"], (tree["peak_bytes"], two_level["peak_bytes"])
    _times_compare(RESULTS / "2026-11-24-cpu-tree-agentic-score.json")
    assert tree["speedup"] >= 0.8 * tree["floor_speedup"], (tree["speedup"], tree["floor_speedup"])
