#!/usr/bin/env bash
# GPU evidence in one short call: exactness, speed and memory stages streamed to $OUT within one deadline.
#
#   OUT=out bash benchmarks/gpu_quick.sh                 # every stage within DEADLINE_S seconds (default 480)
#   OUT=out DEADLINE_S=300 STAGES=S0,S1 bash benchmarks/gpu_quick.sh
#
# Stages S0 (environment) .. S4, S6 (hybrids) and S5 (compile caches, last) are described in
# benchmarks/gpu_quick.py and docs/benchmarks.md.
# Each result is one JSON line appended to $OUT/results.jsonl as soon as it exists; the whole log goes to
# $OUT/quick.log, a Markdown summary to $OUT/summary.md. At most 4 files are written under $OUT (results.jsonl,
# quick.log, summary.md, gpu-cache.tar.gz).
# A stage whose estimated cost exceeds the time left is skipped with that reason; one that overruns its share is
# stopped and recorded as "stopped" with what it had measured (not a failure).
#
# Nothing is fetched: pip never contacts a package index. Pure-Python wheels found in an ignored .whl/ folder are
# installed with --no-index into a temporary directory ($WHEELS names another folder). Compile caches live in
# .gpu-cache/ (ignored), restored from
# .gpu-cache.tar.gz when one lies in the repository root (S5 writes it to $OUT; copy it there to reuse it).
# Without CUDA every stage runs at tiny shapes on CPU (a dry run of the plumbing; tests/bench/test_gpu_quick.py).
# Exit code: 1 when a check failed (or a stage's process ended with an error), else 0 (stages ok, skipped or stopped).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
START=$(date +%s)
OUT=${OUT:-out}
DEADLINE_S=${DEADLINE_S:-480}
STAGES=${STAGES:-S0,S1,S2,S3,S4,S6,S5}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
# pip must never reach an index from here.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export TORCHINDUCTOR_CACHE_DIR="$ROOT/.gpu-cache/inductor" TRITON_CACHE_DIR="$ROOT/.gpu-cache/triton"
LOG="$OUT/quick.log"

log() { echo "$*" | tee -a "$LOG"; }
log "== gpu_quick: commit $GIT_COMMIT, deadline ${DEADLINE_S}s, stages $STAGES, $(date -u +%FT%TZ)"
if [ -f .gpu-cache.tar.gz ] && [ ! -d .gpu-cache ]; then
    tar -xzf .gpu-cache.tar.gz && log "restored compile caches from .gpu-cache.tar.gz"
fi
mkdir -p .gpu-cache
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE=$(mktemp -d)
    if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl \
        >>"$LOG" 2>&1; then
        export PYTHONPATH="$PYTHONPATH:$SITE"
        log "installed wheels from $WHEELS/: $(cd "$WHEELS" && ls -- *.whl | tr '\n' ' ')"
    else
        log "wheels in .whl/ did not install (see above); going on without them"
    fi
fi
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
fi

LEFT=$((DEADLINE_S - ($(date +%s) - START)))
$PY benchmarks/gpu_quick.py run --out "$OUT" --deadline-s "$LEFT" --stages "$STAGES" 2>&1 | tee -a "$LOG"
status=${PIPESTATUS[0]}
$PY benchmarks/gpu_quick.py report "$OUT/results.jsonl" >"$OUT/summary.md" 2>>"$LOG" || log "no summary written"
echo "== gpu_quick: done in $(($(date +%s) - START))s, exit $status" | tee -a "$LOG"
exit "$status"
