"""benchmarks/run_gpu.sh streams what its steps produce into $OUT as they run: every step's output is teed into
$OUT/steps.log and every benchmark record reaches $OUT/bench.jsonl, so a step stopped at its timeout still returns
its output; $OUT holds at most 8 files whatever the number of steps.

No GPU is needed: the script runs with $PYTHON set to a stand-in that prints, writes one streamed record where the
bench CLI would, and then hangs until the step's timeout stops it (anything else goes to the real interpreter)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "run_gpu.sh"

STAND_IN = """#!/usr/bin/env bash
# The bench CLI, pytest and the kernel benchmark print, then hang; everything else is the real interpreter.
if [ "$1" = "-m" ] && [ "$2" = "shared_prefix_logps.cli" ]; then
    out="" name=""
    while [ $# -gt 0 ]; do
        case "$1" in --output) out=$2; shift ;; --name) name=$2; shift ;; esac
        shift
    done
    echo "dense score P=1024 G=4: ok 12.5 ms"
    echo '{"method": "dense", "status": "ok", "median_ms": 12.5}' >>"$out/$name.jsonl"
    exec sleep 120
elif [ "$1" = "-m" ] && [ "$2" = "pytest" ]; then
    echo "tests/gpu/test_gpu.py ..F (stand-in)"
    exec sleep 120
elif [ "$1" = "benchmarks/bench_kernels.py" ]; then
    echo "fused head: 3.2 ms (stand-in)"
    exec sleep 120
fi
exec REAL "$@"
"""


@pytest.mark.skipif(shutil.which("timeout") is None or shutil.which("bash") is None, reason="needs bash and timeout")
def test_steps_stopped_at_their_timeout_still_return_their_output(tmp_path):
    stand_in = tmp_path / "python"
    stand_in.write_text(STAND_IN.replace("REAL", sys.executable))
    stand_in.chmod(0o755)
    out, results = tmp_path / "out", tmp_path / "results"
    env = {
        **os.environ,
        "OUT": str(out),
        "RESULTS": str(results),
        "PYTHON": str(stand_in),
        "STEP_TIMEOUT": "4",
        "GIT_COMMIT": "test",
    }
    steps = ["tests-core", "kernels", "sweep-score-1024", "sweep-train-4096", "maxg"]
    done = subprocess.run(["bash", str(SCRIPT), *steps], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # every step was stopped at its timeout
    files = sorted(p.name for p in out.rglob("*") if p.is_file())
    assert files == ["bench.jsonl", "env.txt", "steps.log"] and len(files) <= 8
    log = (out / "steps.log").read_text()
    for printed in ("tests/gpu/test_gpu.py ..F (stand-in)", "fused head: 3.2 ms (stand-in)", "ok 12.5 ms"):
        assert printed in log
    assert log.count("stopped after 4s (STEP_TIMEOUT)") == len(steps)
    assert log.count("== ") >= len(steps)  # each step's header
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(r["status"] == "ok" for r in records)  # two sweeps and maxg
    assert "commit: test" in (out / "env.txt").read_text()
