#!/usr/bin/env bash
# GPU tests and benchmarks on a CUDA machine, in steps that each fit in about 10 minutes and write at most 8 files
# under $OUT (results to copy into benchmarks/results/ and commit).
#
#   OUT=out bash benchmarks/run_gpu.sh            # every step, one after the other (or: make gpu)
#   OUT=out bash benchmarks/run_gpu.sh tests      # one step: env tests kernels sweep-score sweep-train maxg
#
# `tests` runs every test marked `gpu` in one go; where one call may take only 10 minutes, run its three parts
# instead (the default sequence does): tests-core (kernel and head parity and the other modules' GPU tests),
# tests-exact (tests/gpu/test_gpu.py: expand, flex and chunked_backward against dense in fp32 and bf16, Gemma2 at head
# size 256, flex compilation counts under inductor) and tests-memory (peak memory at P=16k, G=64, C=1k; the kernel
# past 2^31 logits).
#
# Works from a bare checkout without installing the package (it puts the repository on PYTHONPATH) and without .git:
# the commit comes from $GIT_COMMIT, else `git rev-parse HEAD`, else "unknown". Every step records device, versions
# and commit in $OUT/env.txt. Steps run even if an earlier one failed; the exit code is non-zero if any failed.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export GIT_COMMIT
METHODS=dense,trl,kv_expand,prefix_grouper,liger,expand,flex,chunked
status=0

step_env() {
    $PY - >"$OUT/env.txt" <<'PYEOF'
import os, platform, torch, transformers
print("gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
print("python:", platform.python_version(), "torch:", torch.__version__, "transformers:", transformers.__version__)
for name in ("triton", "trl", "peft", "liger_kernel", "prefix_grouper", "cut_cross_entropy"):
    try:
        print(f"{name}:", getattr(__import__(name), "__version__", "installed"))
    except Exception:
        print(f"{name}: not installed")
print("commit:", os.environ.get("GIT_COMMIT", "unknown"))
PYEOF
    cat "$OUT/env.txt"
}

stem() {
    local gpu
    gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-') if torch.cuda.is_available() else 'cpu')")
    echo "$(date +%F)-$gpu"
}

step_tests() {  # $1: log name; the rest: pytest selection
    local name=$1
    shift
    echo "== GPU tests ($name)"
    $PY -m pytest -m gpu -q -ra -p no:cacheprovider "$@" 2>&1 | tee "$OUT/$name.log"
}

step_kernels() {
    echo "== kernel microbenchmark"
    $PY benchmarks/bench_kernels.py 2>&1 | tee "$OUT/kernels.txt"
}

step_sweep() {  # $1: workload (score or train)
    echo "== standard sweep, $1 (qwen2.5-1.5b, C=512)"
    $PY -m shared_prefix_logps.bench.cli bench --preset qwen2.5-1.5b --prompts 1 --prompt-len 1024 4096 16384 \
        --completion-len 512 --generations 4 16 64 --methods "$METHODS" --workloads "$1" --repeats 3 \
        --output "$OUT" --name "$(stem)-$1"
}

step_maxg() {
    echo "== largest G that fits (qwen2.5-7b, P=4096, C=1024)"
    $PY -m shared_prefix_logps.bench.cli bench --preset qwen2.5-7b --prompts 1 --prompt-len 4096 --completion-len 1024 \
        --generations 1 --methods "$METHODS" --workloads train --repeats 1 --max-generations \
        --output "$OUT" --name "$(stem)-maxg-7b"
}

run() {
    case "$1" in
        env) step_env ;;
        tests) step_tests gpu-tests tests ;;
        tests-core) step_tests gpu-tests-core tests --ignore=tests/gpu/test_gpu.py ;;
        tests-exact) step_tests gpu-tests-exact tests/gpu/test_gpu.py -k "not peak_memory and not int32" ;;
        tests-memory) step_tests gpu-tests-memory tests/gpu/test_gpu.py -k "peak_memory or int32" -s ;;
        kernels) step_kernels ;;
        sweep-score) step_sweep score ;;
        sweep-train) step_sweep train ;;
        maxg) step_maxg ;;
        *) echo "unknown step '$1' (env tests tests-core tests-exact tests-memory kernels sweep-score sweep-train maxg)" >&2; return 2 ;;
    esac
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests-core tests-exact tests-memory kernels sweep-score sweep-train maxg)
[ "${steps[0]}" = env ] || step_env || status=1
for name in "${steps[@]}"; do
    run "$name" || status=1
done
exit $status
