#!/usr/bin/env bash
# GPU tests and benchmarks on a CUDA machine, in steps that each stop within $STEP_TIMEOUT seconds (default 570: one
# call may take 10 minutes) and write at most 8 files under $OUT (results to copy into benchmarks/results/ and commit).
#
#   OUT=out bash benchmarks/run_gpu.sh            # every step, one after the other (or: make gpu)
#   OUT=out bash benchmarks/run_gpu.sh tests-memory   # one step (names below)
#
# Steps: deps (pytest and hypothesis: installed when missing and pip can reach an index; without hypothesis its tests
# are reported skipped, without pytest the test steps fail), tests (every test marked `gpu` in one go), or in parts:
# tests-core (kernel and head parity and the other modules' GPU tests), tests-exact-llama and tests-exact-gemma2
# (tests/gpu/test_gpu.py: expand, flex and chunked_backward against dense in fp32 and bf16 per family),
# tests-exact-compile (flex compilation counts under inductor, expand without the math kernel), tests-memory (peak
# memory at P=16k, G=64, C=1k against a prediction from shapes; the kernel past 2^31 logits), kernels, and the sweeps
# sweep-score-<P> / sweep-train-<P> for P in 1024 4096 16384 (one call per prompt length so each fits a step;
# SWEEP_REPEATS sets the repeats, default 3), maxg. A step that reaches $STEP_TIMEOUT is stopped and counted failed.
#
# Works from a bare checkout without installing the package (it puts the repository on PYTHONPATH) and without .git:
# the commit comes from $GIT_COMMIT, else `git rev-parse HEAD`, else "unknown". Every step records device, versions
# and commit in $OUT/env.txt. Steps run even if an earlier one failed; the exit code is non-zero if any failed.
#
# Streaming, so that a step stopped at its timeout (or a run stopped from outside) still returns what it produced:
# every step's output is appended to $OUT/steps.log as it is printed (tee), and every benchmark record to
# $OUT/bench.jsonl (the bench CLI appends each record to <output>/<name>.jsonl as soon as it is measured; each step's
# lines are added to $OUT/bench.jsonl when the step ends, stopped or not). The full per-sweep results (JSON, Markdown,
# plots) go to $RESULTS (default .gpu-results/ in the checkout, not under $OUT). $OUT holds at most 8 files:
# env.txt, steps.log, bench.jsonl; more is reported as a failure.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUT=${OUT:-out}
RESULTS=${RESULTS:-$ROOT/.gpu-results}
mkdir -p "$OUT" "$RESULTS"
LOG="$OUT/steps.log"
MAX_OUT_FILES=8
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export GIT_COMMIT
METHODS=dense,trl,kv_expand,prefix_grouper,liger,expand,flex,chunked
STEP_TIMEOUT=${STEP_TIMEOUT:-570}
SWEEP_REPEATS=${SWEEP_REPEATS:-3}
SWEEP_PROMPT_LENS=(1024 4096 16384)
status=0
deps_checked=0

bounded() {  # the command, stopped after $STEP_TIMEOUT seconds (exit code 124, reported), its output teed to $LOG
    timeout --kill-after=30 "$STEP_TIMEOUT" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "!! stopped after ${STEP_TIMEOUT}s (STEP_TIMEOUT): $*" | tee -a "$LOG" >&2
    fi
    return "$rc"
}

header() {  # a step's title, on the console and in $LOG
    echo "== $* ($(date -u +%FT%TZ))" | tee -a "$LOG"
}

collect_records() {  # $1: the bench --name of a step: its streamed records appended to $OUT/bench.jsonl
    local records="$RESULTS/$1.jsonl"
    [ -f "$records" ] && cat "$records" >>"$OUT/bench.jsonl" && rm -f "$records"
    return 0
}

step_deps() {  # pytest and hypothesis, installed when missing (the GPU machine may have no package index)
    deps_checked=1
    local pkg
    for pkg in pytest hypothesis; do
        if $PY -c "import $pkg" 2>/dev/null; then
            echo "$pkg: $($PY -c "import $pkg; print($pkg.__version__)")"
        elif timeout 180 $PY -m pip install --quiet --disable-pip-version-check --retries 1 --timeout 15 "$pkg"; then
            echo "$pkg: installed $($PY -c "import $pkg; print($pkg.__version__)")"
        else
            echo "$pkg: missing, and pip could not install it"
        fi
    done
    $PY -c "import hypothesis" 2>/dev/null ||
        echo "without hypothesis, tests/core/test_property.py is reported skipped; the other tests run"
    $PY -c "import pytest" 2>/dev/null || { echo "pytest is missing: the test steps cannot run" >&2; return 1; }
}

step_env() {
    $PY - >"$OUT/env.txt" <<'PYEOF'
import os, platform, torch, transformers
print("gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
print("python:", platform.python_version(), "torch:", torch.__version__, "transformers:", transformers.__version__)
for name in ("triton", "trl", "peft", "liger_kernel", "prefix_grouper", "cut_cross_entropy", "pytest", "hypothesis"):
    try:
        print(f"{name}:", getattr(__import__(name), "__version__", "installed"))
    except Exception:
        print(f"{name}: not installed")
if torch.cuda.is_available():  # whether the fused head will use the Triton kernels (a C compiler, or a trial launch)
    from shared_prefix_logps.kernels import launch_probe

    status = launch_probe.cuda_launch_status(torch.device("cuda"))
    print("triton kernels:", "launch" if status.ok else "do not launch", f"({status.reason})")
print("commit:", os.environ.get("GIT_COMMIT", "unknown"))
PYEOF
    cat "$OUT/env.txt"
}

stem() {
    local gpu
    gpu=$($PY -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '-') if torch.cuda.is_available() else 'cpu')")
    echo "$(date +%F)-$gpu"
}

step_tests() {  # $1: the step's name; the rest: pytest selection
    local name=$1
    shift
    header "GPU tests ($name)"
    [ $deps_checked -eq 1 ] || step_deps > >(tee -a "$LOG") 2>&1
    $PY -c "import pytest" 2>/dev/null || { echo "pytest is missing: $name not run" | tee -a "$LOG" >&2; return 1; }
    bounded $PY -m pytest -m gpu -q -ra -p no:cacheprovider "$@"
}

step_kernels() {
    header "kernel microbenchmark"
    bounded $PY benchmarks/bench_kernels.py
}

step_bench() {  # $1: the bench --name; the rest: bench arguments. Records stream to $RESULTS/$1.jsonl, then $OUT.
    local name=$1 rc
    shift
    bounded $PY -m shared_prefix_logps.cli bench "$@" --output "$RESULTS" --name "$name"
    rc=$?
    collect_records "$name"
    return $rc
}

step_sweep() {  # $1: workload (score or train); $2: prompt length
    header "standard sweep, $1 (qwen2.5-1.5b, P=$2, C=512)"
    step_bench "$(stem)-$1-p$2" --preset qwen2.5-1.5b --prompts 1 --prompt-len "$2" --completion-len 512 \
        --generations 4 16 64 --methods "$METHODS" --workloads "$1" --repeats "$SWEEP_REPEATS"
}

step_maxg() {
    header "largest G that fits (qwen2.5-7b, P=4096, C=1024)"
    step_bench "$(stem)-maxg-7b" --preset qwen2.5-7b --prompts 1 --prompt-len 4096 --completion-len 1024 \
        --generations 1 --methods "$METHODS" --workloads train --repeats 1 --max-generations
}

# tests/gpu/test_gpu.py in parts: the parametrized exactness tests per family (their ids name it), then the rest.
GPU_TESTS=tests/gpu/test_gpu.py
run() {
    case "$1" in
        env) step_env > >(tee -a "$LOG") 2>&1 ;;
        deps) step_deps > >(tee -a "$LOG") 2>&1 ;;
        tests) step_tests gpu-tests tests ;;
        tests-core) step_tests gpu-tests-core tests --ignore=tests/gpu/test_gpu.py ;;
        tests-exact-llama) step_tests gpu-tests-exact-llama $GPU_TESTS -k "(matches_dense or bf16_error) and llama" ;;
        tests-exact-gemma2) step_tests gpu-tests-exact-gemma2 $GPU_TESTS -k "(matches_dense or bf16_error) and gemma2" ;;
        tests-exact-compile) step_tests gpu-tests-exact-compile $GPU_TESTS -k "compilations or math_kernel" ;;
        tests-memory) step_tests gpu-tests-memory $GPU_TESTS -k "peak_memory or int32" -s ;;
        kernels) step_kernels ;;
        sweep-score-*) step_sweep score "${1#sweep-score-}" ;;
        sweep-train-*) step_sweep train "${1#sweep-train-}" ;;
        maxg) step_maxg ;;
        *) echo "unknown step '$1' (env deps tests tests-core tests-exact-llama tests-exact-gemma2 tests-exact-compile" \
            "tests-memory kernels sweep-score-<P> sweep-train-<P> maxg)" >&2; return 2 ;;
    esac
}

steps=("$@")
if [ ${#steps[@]} -eq 0 ]; then
    steps=(deps tests-core tests-exact-llama tests-exact-gemma2 tests-exact-compile tests-memory kernels)
    for p in "${SWEEP_PROMPT_LENS[@]}"; do steps+=("sweep-score-$p"); done
    for p in "${SWEEP_PROMPT_LENS[@]}"; do steps+=("sweep-train-$p"); done
    steps+=(maxg)
fi
command -v timeout >/dev/null || { echo "run_gpu.sh needs coreutils' timeout to bound its steps" >&2; exit 2; }
[ "${steps[0]}" = env ] || run env || status=1
for name in "${steps[@]}"; do
    run "$name" || status=1
done
files=$(find "$OUT" -type f | wc -l)
if [ "$files" -gt "$MAX_OUT_FILES" ]; then
    echo "!! $OUT holds $files files, more than $MAX_OUT_FILES" | tee -a "$LOG" >&2
    status=1
fi
exit $status
