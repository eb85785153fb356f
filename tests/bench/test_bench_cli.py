"""Smoke test of the benchmark CLI on the CPU tiny preset: every method that can run on CPU runs and agrees."""

import json

import pytest
import torch

from shared_prefix_logps.bench.cli import main
from shared_prefix_logps.bench.methods import METHODS

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_tiny_preset_runs_every_cpu_method(tmp_path, restore_threads):
    torch.set_num_threads(2)
    code = main(
        [
            "bench",
            "--device",
            "cpu",
            "--preset",
            "tiny",
            "--layers",
            "1",
            "--prompts",
            "2",
            "--prompt-len",
            "24",
            "--completion-len",
            "6",
            "--generations",
            "2",
            "4",
            "--repeats",
            "1",
            "--methods",
            ",".join(METHODS),
            "--output",
            str(tmp_path),
            "--name",
            "smoke",
        ]
    )
    assert code == 0
    data = json.loads((tmp_path / "smoke.json").read_text())
    records = data["records"]
    assert data["meta"]["versions"]["torch"]
    assert data["meta"]["threads"] == 1 == torch.get_num_threads()  # one CPU thread unless asked otherwise
    assert "load_average" in data["meta"]
    assert len(records) == len(METHODS) * 2 * 2  # methods x G values x workloads
    by_status = {}
    for record in records:
        by_status.setdefault(record["status"], []).append(record)
        assert record["prompt_tokens"] == 24 + 12  # prompts of 24 (= P) and 12 real tokens
        assert 0 < record["token_floor"] < record["flop_floor"] < 1
        if record["status"] == "ok":
            assert record["median_ms"] > 0
            if record["method"] != "dense":
                assert record["max_abs_diff_vs_dense"] <= 1e-5, record
    assert "error" not in by_status and "OOM" not in by_status
    # Only flex's backward (CUDA-only) and methods whose package is missing may be skipped on CPU.
    for r in by_status.get("skipped", []):
        assert (r["method"], r["workload"]) == ("flex", "train") or r["reason"].startswith("not installed"), r
    assert (tmp_path / "smoke.md").read_text().startswith("# Benchmark: tiny")
    pytest.importorskip("matplotlib")
    assert (tmp_path / "smoke-memory_vs_g.png").stat().st_size > 0
    assert (tmp_path / "smoke-time_vs_p.png").stat().st_size > 0


def test_unknown_method_is_refused():
    with pytest.raises(SystemExit, match="unknown method"):
        main(["bench", "--device", "cpu", "--methods", "dense,nope"])


def test_bad_sizes_and_threads_are_refused(restore_threads):
    with pytest.raises(SystemExit, match="--threads must be >= 0"):
        main(["bench", "--device", "cpu", "--threads", "-1"])
    with pytest.raises(SystemExit, match="prompt_len must be a positive int"):
        main(["bench", "--device", "cpu", "--prompt-len", "0", "--methods", "dense"])
