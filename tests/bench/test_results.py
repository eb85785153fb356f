"""The committed benchmark results hold what the runner promises: real token counts, floors recomputed from the
shapes, and no speed-up over dense beyond what the FLOP floor allows (plus timing noise)."""

import json
from pathlib import Path

import pytest

from shared_prefix_logps.bench.flops import ModelShape, Workload, flop_floor
from shared_prefix_logps.bench.presets import preset_config
from shared_prefix_logps.bench.report import FLOP_BOUND_TOLERANCE, beyond_flop_bound, speedups_over_dense
from shared_prefix_logps.bench.runner import Shape, make_batch

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _is_bench_run(path: Path) -> bool:
    """A ``shared-prefix-logps bench`` run on GRPO batches (other scripts write other JSON here; tree runs are checked
    by test_tree_results.py, kernel counts by test_kernel_count.py)."""
    data = json.loads(path.read_text())
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    return "preset" in meta and "tree_workload" not in meta and "count" not in meta and "records" in data


FILES = sorted(p for p in RESULTS.glob("*.json") if _is_bench_run(p))


def test_there_are_committed_runs():
    assert FILES, f"no benchmark results in {RESULTS}"


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_records_count_real_tokens(path):
    data = json.loads(path.read_text())
    config = preset_config(data["meta"]["preset"], layers=data["meta"]["layers"])
    shape_of = ModelShape.from_config(config)
    for record in data["records"]:
        shape = Shape(record["prompts"], record["prompt_len"], record["completion_len"], record["generations"])
        batch = make_batch(shape, config.vocab_size, "cpu")
        workload = Workload.from_masks(batch.prompt_mask, batch.completion_mask)
        if shape.prompts == 1:
            assert record["prompt_tokens"] == shape.prompt_len, record  # one prompt of length P: P real tokens
        assert record["prompt_tokens"] == workload.prompt_tokens
        assert (
            record["completion_tokens"]
            == workload.completion_tokens
            <= shape.prompts * shape.generations * (shape.completion_len)
        )
        assert record["dense_tokens"] == shape.generations * record["prompt_tokens"] + record["completion_tokens"]
        assert record["shared_tokens"] == record["prompt_tokens"] + record["completion_tokens"]
        assert record["token_floor"] == pytest.approx(record["shared_tokens"] / record["dense_tokens"])
        train = record["workload"] == "train"
        assert record["flop_floor"] == pytest.approx(flop_floor(shape_of, workload, train=train))
        if record["status"] == "ok":
            assert record["tokens_per_s"] == pytest.approx(record["dense_tokens"] / (record["median_ms"] / 1e3))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_speedup_beyond_the_flop_bound(path):
    records = json.loads(path.read_text())["records"]
    speedups = [s for s in speedups_over_dense(records) if s is not None]
    assert len(speedups) > len({r["method"] for r in records}), "too few timed records to check"
    beyond = [(r["method"], r["workload"], r["prompt_len"], r["generations"]) for r in beyond_flop_bound(records)]
    assert not beyond, f"faster than dense by more than {1 + FLOP_BOUND_TOLERANCE} / flop_floor: {beyond}"


def test_the_bound_check_flags_a_speedup_beyond_it():
    base = dict(workload="score", prompts=1, prompt_len=8, completion_len=4, generations=2, status="ok", flop_floor=0.5)
    records = [
        dict(base, method="dense", median_ms=100.0),
        dict(base, method="inside", median_ms=52.0),  # 1.92x, the floor allows 2x
        dict(base, method="beyond", median_ms=40.0),  # 2.5x
        dict(base, method="failed", status="OOM"),
    ]
    assert [r["method"] for r in beyond_flop_bound(records)] == ["beyond"]
    assert speedups_over_dense(records) == [1.0, 100 / 52, 2.5, None]
