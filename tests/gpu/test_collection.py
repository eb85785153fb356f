"""The GPU script's test run collects on a bare image: runs on CPU, in ``make test``.

``benchmarks/run_gpu.sh`` runs ``pytest -m gpu tests`` where the optional packages may be missing (the GPU image has
torch, transformers and Triton, maybe not hypothesis, TRL, PEFT, Liger ...). One collection error stops the whole
run before any test, so every test module must import without them, skipping what needs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Optional packages the GPU image may lack; hypothesis is a dev extra, the others extras or competitors.
OPTIONAL = (
    "hypothesis",
    "trl",
    "peft",
    "liger_kernel",
    "prefix_grouper",
    "deepspeed",
    "verl",
    "flash_attn",
    "cut_cross_entropy",
)


def _unimportable(directory: Path, names) -> None:
    """Packages in ``directory`` (put first on PYTHONPATH) that raise what a missing package raises."""
    for name in names:
        (directory / name).mkdir()
        (directory / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n"
        )


def test_tests_collect_without_the_optional_packages(tmp_path):
    _unimportable(tmp_path, OPTIONAL)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    # The hypothesis plugin is registered by the installed package; without the package there is none.
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "no:hypothesispytest", "tests"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    summary = output.strip().splitlines()[-1]
    assert done.returncode == 0, output[-3000:]
    assert "error" not in summary, summary
    collected = [line for line in done.stdout.splitlines() if "::" in line]
    gpu_tests = [line for line in collected if line.startswith("tests/gpu/test_gpu.py::")]
    assert len(gpu_tests) >= 20, summary  # the GPU exactness and memory tests are all there
    # The hypothesis module skipped (pytest's collect-only summary does not count module skips).
    assert not any(line.startswith("tests/core/test_property.py::") for line in collected)
