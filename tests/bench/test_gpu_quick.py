"""``benchmarks/gpu_quick.sh`` as a CPU dry run: every stage S0-S6 leaves a result line (ok, or skipped with its
reason) within the deadline, the script writes few files, installs wheels from a local folder without contacting a
package index, and a short deadline skips the stages that do not fit instead of overrunning."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_quick.sh"
STAGES = ("S0", "S1", "S2", "S3", "S4", "S6", "S5")


def _tiny_wheel(folder: Path) -> Path:
    """A minimal pure-Python wheel (one module, ``spl_quick_probe``) that pip can install with --no-index."""
    name, version = "spl_quick_probe", "0.1"
    files = {
        f"{name}.py": b"VALUE = 42\n",
        f"{name}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{name}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = f"{name}-{version}.dist-info/RECORD"
    lines = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(data)}")
    lines.append(f"{record},,")
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
        archive.writestr(record, "\n".join(lines) + "\n")
    return wheel


def _run(out: Path, deadline_s: int, tmp_path: Path, **env) -> tuple[subprocess.CompletedProcess, float]:
    environment = {
        **os.environ,
        "OUT": str(out),
        "DEADLINE_S": str(deadline_s),
        "PYTHON": sys.executable,
        # Any index pip might try is unreachable: an install that needed one would fail and say so in the log.
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_EXTRA_INDEX_URL": "http://127.0.0.1:9/simple",
        "CUDA_VISIBLE_DEVICES": "",
        **env,
    }
    start = time.time()
    done = subprocess.run(
        ["bash", str(SCRIPT)], env=environment, capture_output=True, text=True, timeout=deadline_s + 60
    )
    return done, time.time() - start


def _results(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]


def _stage_lines(results: list[dict]) -> dict[str, dict]:
    return {r["stage"]: r for r in results if r["name"] == "stage"}


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_dry_run_every_stage_within_the_deadline(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _tiny_wheel(wheels)
    out = tmp_path / "out"
    done, seconds = _run(out, 300, tmp_path, WHEELS=str(wheels))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert seconds <= 300
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    results = _results(out)
    stages = _stage_lines(results)
    assert set(stages) == set(STAGES), stages
    assert all(stages[s]["status"] == "ok" for s in STAGES), stages  # on CPU every stage fits 300 s
    failed = [r for r in results if r["status"] == "failed"]
    assert not failed, failed
    for r in results:
        if r["status"] == "skipped":
            assert r.get("reason"), r
    # Checks with figures, not only stage lines: exactness against dense in S1, a speed cell in S2, memory in S3.
    names = {(r["stage"], r["name"]) for r in results if r["status"] == "ok"}
    assert ("S1", "fp32 expand train (llama)") in names and ("S2", "score speed cell") in names
    s1 = next(r for r in results if r["name"] == "fp32 expand train (llama)")
    assert s1["logps_max_abs"] <= 1e-4 and s1["grad_max_rel"] <= 1e-3
    memory = next(r for r in results if r["name"] == "peak memory expand score")
    assert 0.5 <= memory["measured_over_planned"] <= 1.2, memory
    log = (out / "quick.log").read_text()
    assert "installed wheels from" in log and "spl_quick_probe" in log, log[-2000:]
    assert "127.0.0.1:9" not in log  # pip never tried the (unreachable) index
    summary = (out / "summary.md").read_text()
    assert "| S1 | fp32 expand train (llama) | ok |" in summary


@pytest.mark.skipif(sys.platform == "win32", reason="bash script")
def test_short_deadline_skips_what_does_not_fit(tmp_path):
    out = tmp_path / "out"
    done, seconds = _run(out, 30, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert seconds <= 45, seconds
    results = _results(out)
    stages = _stage_lines(results)
    assert set(stages) == set(STAGES), stages
    skipped = [s for s in STAGES if stages[s]["status"] == "skipped"]
    assert skipped, stages  # 30 s cannot hold every stage's estimate
    assert all("left before the deadline" in stages[s]["reason"] for s in skipped)
    assert stages["S5"]["status"] == "ok"  # its time is kept back
