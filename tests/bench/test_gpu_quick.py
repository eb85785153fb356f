"""``benchmarks/gpu_quick.sh`` as a CPU dry run: every stage S0-S6 leaves a result line (ok, or skipped with its
reason) within the deadline, the script writes few files, installs wheels from a local folder without contacting a
package index, and a short deadline skips the stages that do not fit instead of overrunning. A stage the deadline
stops is recorded as stopped with what it had measured, and fails the run only if one of its checks had failed."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
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


@pytest.mark.slow
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
    # On a loaded machine a stage may overrun its share: stopped, which is no failure (the exit code above is 0).
    assert {stages[s]["status"] for s in STAGES} <= {"ok", "skipped", "stopped"}, stages
    assert all("stopped at the end of its" in stages[s]["reason"] for s in STAGES if stages[s]["status"] == "stopped")
    assert stages["S5"]["status"] == "ok"  # its time is kept back


def _load_gpu_quick():
    spec = importlib.util.spec_from_file_location("gpu_quick_under_test", ROOT / "benchmarks" / "gpu_quick.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: A stand-in for a stage's process: records one check (ok, or failed with ``fails-then-hangs``), then exits
#: (``quick``), exits with an error (``exits-1``), or starts a line it never finishes and hangs: a slow stage.
FAKE_STAGE = """
import json, sys, time
stage, results, behaviour = sys.argv[1:4]
with open(results, "a") as handle:
    status = "failed" if behaviour == "fails-then-hangs" else "ok"
    handle.write(json.dumps({"stage": stage, "name": "first check", "status": status, "figure": 1.5}) + "\\n")
    if behaviour == "exits-1":
        sys.exit(1)
    if behaviour != "quick":
        handle.write('{"stage": "' + stage + '", "name": "second ch')
        handle.flush()
        time.sleep(120)
"""


def _run_fake_stages(tmp_path, monkeypatch, behaviours: dict[str, str]) -> tuple[int, list[str], float]:
    """``run_all`` over fake stages (S0 with its behaviour, then S5) with a 4 s deadline, 2 s of it kept for S5: S0
    has a 2 s share and is stopped 0.5 s after it. Returns the exit code, the results' lines and the seconds taken."""
    quick = _load_gpu_quick()
    monkeypatch.setattr(quick, "_cuda_present", lambda: False)
    monkeypatch.setattr(quick, "ESTIMATE_S", {"cpu": dict.fromkeys(STAGES, 0), "cuda": dict.fromkeys(STAGES, 0)})
    monkeypatch.setattr(quick, "S5_RESERVE_S", 2.0)
    monkeypatch.setattr(quick, "STOP_GRACE_S", 0.5)

    def command(stage, out, until):
        return [sys.executable, "-c", FAKE_STAGE, stage, str(out / "results.jsonl"), behaviours.get(stage, "quick")]

    out = tmp_path / "out"
    start = time.time()
    code = quick.run_all(out, time.time() + 4, ("S0", "S5"), command=command)
    seconds = time.time() - start
    (tmp_path / "summary.md").write_text(quick.markdown_summary(out / "results.jsonl"))
    return code, (out / "results.jsonl").read_text().splitlines(), seconds


def _parsed(lines: list[str]) -> list[dict]:
    return [json.loads(line) for line in lines if not line.endswith('"second ch')]


def test_a_stage_stopped_by_the_deadline_is_recorded_as_stopped_not_failed(tmp_path, monkeypatch):
    code, lines, seconds = _run_fake_stages(tmp_path, monkeypatch, {"S0": "hangs"})
    assert code == 0
    assert seconds < 30  # stopped, not waited for (it sleeps 120 s)
    # The line the stopped process left unfinished stays a line of its own; every other line is whole JSON.
    assert [line for line in lines if line.endswith('"second ch')] == ['{"stage": "S0", "name": "second ch']
    results = _parsed(lines)
    stages = _stage_lines(results)
    assert stages["S0"]["status"] == "stopped"
    assert stages["S0"]["measured"] == ["first check"] and "failed_checks" not in stages["S0"]
    assert "stopped at the end of its 2 s share" in stages["S0"]["reason"]
    assert stages["S5"]["status"] == "ok"  # the stages after it still run
    check = next(r for r in results if r["name"] == "first check")
    assert check["figure"] == 1.5  # what it measured before it was stopped stays
    end = results[-1]
    assert (end["name"], end["status"], end["failed_stages"], end["stopped_stages"]) == ("end", "ok", 0, 1)
    assert "| S0 | stage | stopped |" in (tmp_path / "summary.md").read_text()


def test_a_stopped_stage_whose_check_failed_fails_the_run(tmp_path, monkeypatch):
    code, lines, _ = _run_fake_stages(tmp_path, monkeypatch, {"S0": "fails-then-hangs"})
    assert code == 1
    results = _parsed(lines)
    stages = _stage_lines(results)
    assert stages["S0"]["status"] == "stopped" and stages["S0"]["failed_checks"] == ["first check"]
    assert stages["S0"]["measured"] == []
    assert (results[-1]["status"], results[-1]["failed_stages"]) == ("failed", 1)


def test_a_stage_that_ends_with_an_error_fails_the_run(tmp_path, monkeypatch):
    code, lines, seconds = _run_fake_stages(tmp_path, monkeypatch, {"S0": "exits-1"})
    assert code == 1
    assert seconds < 3  # it ended on its own, before its share
    stages = _stage_lines(_parsed(lines))
    assert stages["S0"]["status"] == "failed" and "exit code 1" in stages["S0"]["reason"]
    assert stages["S5"]["status"] == "ok"
