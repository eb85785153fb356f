#!/usr/bin/env bash
# One command for a CUDA machine: GPU tests, kernel microbenchmark and the standard sweep, results under $OUT.
#
#   OUT=out bash benchmarks/run_gpu.sh          # or: make gpu
#
# Writes $OUT/env.txt, $OUT/gpu-tests.log, $OUT/kernels.txt and $OUT/<date>-<gpu>.{json,md} plus PNG plots;
# copy them to benchmarks/results/ and commit. Every step runs even if an earlier one fails; the exit code is
# non-zero if any failed.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0

$PY - >"$OUT/env.txt" <<'PYEOF'
import platform, subprocess, torch, transformers
print("gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
print("python:", platform.python_version(), "torch:", torch.__version__, "transformers:", transformers.__version__)
for name in ("triton", "trl", "peft", "liger_kernel", "cut_cross_entropy"):
    try:
        print(f"{name}:", __import__(name).__version__)
    except Exception:
        print(f"{name}: not installed")
print("commit:", subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
PYEOF
cat "$OUT/env.txt"
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-') if torch.cuda.is_available() else 'cpu')")
stem="$(date +%F)-$gpu"

echo "== GPU tests"
$PY -m pytest tests -m gpu -q -ra 2>&1 | tee "$OUT/gpu-tests.log" || status=1

echo "== kernel microbenchmark"
$PY benchmarks/bench_kernels.py 2>&1 | tee "$OUT/kernels.txt" || status=1

echo "== standard sweep (qwen2.5-1.5b, C=512)"
$PY -m shared_prefix_logps.cli bench --preset qwen2.5-1.5b --prompts 1 --prompt-len 1024 4096 16384 \
    --completion-len 512 --generations 4 16 64 --methods dense,trl,kv_expand,prefix_grouper,liger,expand,flex,chunked \
    --workloads score,train --repeats 3 --output "$OUT" --name "$stem" || status=1

echo "== largest G that fits (qwen2.5-7b, P=4096, C=1024)"
$PY -m shared_prefix_logps.cli bench --preset qwen2.5-7b --prompts 1 --prompt-len 4096 --completion-len 1024 \
    --generations 1 --methods dense,trl,kv_expand,prefix_grouper,liger,expand,flex,chunked --workloads train --repeats 1 \
    --max-generations --output "$OUT" --name "$stem-maxg-7b" || status=1

exit $status
