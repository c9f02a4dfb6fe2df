#!/usr/bin/env bash
# The GPU check in one command: install tilelang from .whl/ when it is missing, build every
# kernel (in parallel, into TileLang's disk cache), run the GPU tests, run the benchmark, and
# print a short table last (also written under $OUT when set, else /tmp/attngen-gpu-check).
#
#   bash bench/gpu_check.sh             # on an H200 (the device tool: carry [".whl"])
#   bash bench/gpu_check.sh --dry-run   # without a GPU: everything except the launches
#
# Prepare .whl/ and .seed/ first, on a machine with internet: bash bench/prepare_wheels.sh (docs/gpu.md);
# the device call then carries both: carry [".whl", ".seed"].
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
[[ "${1:-}" == "--dry-run" ]] && DRY=1
OUTDIR="${OUT:-/tmp/attngen-gpu-check}"
mkdir -p "$OUTDIR"
rm -f "$OUTDIR"/{summary.md,pytest.log,bench.md,bench.json,bench.log,smoke.json,sanitizer.log,serving.md,serving.json,serving.log,goals.log}  # no stale table
rm -rf "$OUTDIR/goals"
# The whole script, install included: 330 s leaves a 15-minute lease room for the machine's start,
# the upload and a second try (../shared/gpu-preflight.md).
BUDGET=${GPU_CHECK_BUDGET_S:-330}
export ATTNGEN_LOG_DIR="$OUTDIR"  # whole build-error logs land beside the summary
export PYTHONUNBUFFERED=1
export TILELANG_CACHE_DIR="${TILELANG_CACHE_DIR:-/tmp/attngen-tlcache}"
PY=(python3 -P)  # -P: never import attngen from the checkout (its templates/ maps in only when installed)
SECONDS=0

# Run a stage under `timeout`: at most $cap seconds, and never into the last $reserve seconds.
stage() {
  local name=$1 cap=$2 reserve=$3
  shift 3
  local t=$((BUDGET - SECONDS - reserve))
  ((t > cap)) && t=$cap
  if ((t < 15)); then
    echo "== $name: skipped, the time budget is spent"
    return 124
  fi
  echo "== $name (limit ${t} s, ${SECONDS} s elapsed)"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$t" "$@"
  rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s" >&2
  return $rc
}

echo "== attngen GPU check$([[ $DRY == 1 ]] && echo ' (DRY RUN: no launches)'), output in $OUTDIR"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv,noheader

# 1. tilelang: the H200 image lacks it and cannot download; the wheels travel in .whl/.
if ! "${PY[@]}" -c "import tilelang" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "tilelang is not installed and .whl/ holds no wheels: run bench/prepare_wheels.sh (docs/gpu.md)"
    exit 3
  fi
  echo "== installing $(ls .whl/*.whl | wc -l) wheels into /tmp/site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi

# 2. attngen: templates/ becomes attngen.templates only through the package build (pyproject).
if ! "${PY[@]}" -c "import attngen.templates" 2>/dev/null; then
  echo "== installing attngen from this checkout into /tmp/attngen-site"
  rm -rf /tmp/attngen-site
  if ! python3 -m pip install -q --no-deps --no-index --no-build-isolation --no-compile --target /tmp/attngen-site . ; then
    # no usable setuptools there: lay the package out by hand, as pyproject's package-dir does
    mkdir -p /tmp/attngen-site && cp -r attngen /tmp/attngen-site/ && cp -r templates /tmp/attngen-site/attngen/templates
  fi
  export PYTHONPATH="/tmp/attngen-site${PYTHONPATH:+:$PYTHONPATH}"
fi
"${PY[@]}" -c "
import shutil, attngen, attngen.templates, tilelang, torch
from tilelang import env
print('attngen', attngen.__version__, '| tilelang', tilelang.__version__, '| torch', torch.__version__, '| install', $SECONDS, 's')
print('nvcc on PATH:', shutil.which('nvcc'), '| TileLang CUDA_HOME:', getattr(env, 'CUDA_HOME', None),
      '| torch.Tensor.__dlpack_c_exchange_api__:', hasattr(torch.Tensor, '__dlpack_c_exchange_api__'))
" || exit 3

# 3. every kernel the tests and the benchmark use, built in parallel (nvcc is single-threaded): the
#    forward presets, the backward presets' modules (every part) with the forward autograd runs, and
#    the benchmark's forward and backward rows, into the runtime cache the later stages load
#    200 s is for the H200 box's 16 cores; with fewer (a dry run here) the cap grows in proportion
BUILD_CAP=$((200 * 16 / $(nproc)))
((BUILD_CAP < 200)) && BUILD_CAP=200
stage "build kernels" "$BUILD_CAP" 200 "${PY[@]}" bench/bench_gpu.py --prebuild-only -j "$(nproc)" 2>&1 | grep -v "TileLang begins\|TileLang completes"
BUILD_RC=${PIPESTATUS[0]}

# 4. one small launch per preset, each in its own process: a kernel that hangs costs one timeout here
#    and is left out of the tests and the benchmark below
SMOKE_ARGS=(--timeout 60 --load-timeout 120 --json "$OUTDIR/smoke.json")
[[ $DRY == 1 ]] && SMOKE_ARGS+=(--dry-run)
stage "smoke: one launch per preset" 150 150 "${PY[@]}" bench/gpu_smoke.py "${SMOKE_ARGS[@]}"
SMOKE_RC=$?
HUNG=$("${PY[@]}" -c "import json,sys; print(' '.join(k for k,v in json.load(open(sys.argv[1])).items() if v.startswith('HANG')))" "$OUTDIR/smoke.json" 2>/dev/null)
PYTEST_SELECT=()
BENCH_PRESETS=examples/*.toml
if [[ -n "$HUNG" ]]; then
  echo "== left out of the tests and the benchmark (hung): $HUNG"
  PYTEST_SELECT=(-k "not $(echo $HUNG | sed 's/ / and not /g')")
  BENCH_PRESETS=$(for f in examples/*.toml; do n=$(basename "$f" .toml); [[ " $HUNG " == *" $n "* ]] || printf '%s,' "$f"; done)
fi

# 4b. the goal rows of issues 29 and 30 (fp8 hd128 non-causal at 16k beside our fp16 kernel; persistent
#     beside single-tile, hd128 causal at 1k, 4k and 16k), early, so that the tests cannot crowd them out;
#     the benchmark below runs every other row
GOAL_ARGS=(--rows goals --backward-share 0 --budget-s 45 -j 1 --out "$OUTDIR/goals" --presets "$BENCH_PRESETS")
[[ $DRY == 1 ]] && GOAL_ARGS+=(--dry-run)
stage "benchmark: goal rows" 60 110 "${PY[@]}" bench/bench_gpu.py "${GOAL_ARGS[@]}" 2>&1 | grep -v "TileLang begins\|TileLang completes" > "$OUTDIR/goals.log"
GOAL_RC=${PIPESTATUS[0]}
grep "^|" "$OUTDIR/goals.log" | tail -n 12

# 5. GPU tests (they skip cleanly without a compute capability 9.0 device); no shrinking on a failure
export ATTNGEN_HYPOTHESIS_PROFILE=gpu
"${PY[@]}" -c "import pytest_timeout" 2>/dev/null && PYTEST_SELECT+=(--timeout=90)  # the H200 image has it
stage "pytest -m gpu" 200 110 "${PY[@]}" -m pytest -m gpu -v -rs -p no:cacheprovider --maxfail=5 \
  "${PYTEST_SELECT[@]}" tests/test_gpu.py tests/test_gpu_backward.py tests/test_gpu_serving.py tests/test_gpu_persistent.py tests/test_gpu_kv_cache_fp8.py tests/test_ops.py tests/test_ops_backward.py 2>&1 | tee "$OUTDIR/pytest.log" | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed|Timeout" | tail -n 40
TEST_RC=${PIPESTATUS[0]}

# 6. compute-sanitizer racecheck and synccheck on one small launch of two presets (skipped in a dry run)
SAN_RC=0
if [[ $DRY == 0 ]] && command -v compute-sanitizer >/dev/null; then
  for preset in examples/default.toml examples/hd64_bf16_gqa4_c3.toml; do
    for tool in racecheck synccheck; do
      stage "compute-sanitizer $tool $(basename "$preset")" 60 90 compute-sanitizer --tool "$tool" --error-exitcode 9 \
        "${PY[@]}" bench/gpu_smoke.py --one "$preset" >> "$OUTDIR/sanitizer.log" 2>&1 || SAN_RC=$?
      tail -n 3 "$OUTDIR/sanitizer.log"
    done
  done
fi

# 7. the timeline of the default preset from clock64 stamps (attngen timeline --gpu, docs/timeline.md):
#    the stamped build, its overhead against the plain kernel, and the chart; a dry run only builds it
TL_RC=0
if [[ $DRY == 1 ]]; then
  stage "timeline: build the stamped kernel" 120 150 "${PY[@]}" -c \
    "from attngen.timeline.gpu import build_stamped; print(build_stamped('examples/default.toml'))" 2>&1 | tail -n 3
  TL_RC=${PIPESTATUS[0]}
else
  stage "timeline --gpu (default preset, 1x2x2048x2048)" 90 120 "${PY[@]}" -c \
    "import sys; from attngen.cli import main; sys.exit(main(sys.argv[1:]))" timeline examples/default.toml \
    --kv-heads 2 --q-len 2048 --kv-len 2048 --gpu -o "$OUTDIR/timeline.html" 2>&1 | grep -v "TileLang begins\|TileLang completes" | tail -n 5
  TL_RC=${PIPESTATUS[0]}
fi

# 8. the serving benchmark (decode bandwidth against a device copy, varlen prefill against dense); short
SERVE_ARGS=(--out "$OUTDIR" --budget-s 35)
[[ $DRY == 1 ]] && SERVE_ARGS+=(--dry-run)
stage "serving benchmark" 50 100 "${PY[@]}" bench/bench_serving.py "${SERVE_ARGS[@]}" 2>&1 | grep -v "TileLang begins\|TileLang completes" > "$OUTDIR/serving.log"
SERVE_RC=${PIPESTATUS[0]}
grep "^|" "$OUTDIR/serving.log" | tail -n 20

# 9. the benchmark: forward rows, then backward rows (the last 40% of its budget, or more when the
#    forward finishes early); it stops starting rows 40 s before its limit so the table is always printed
BENCH_T=$((BUDGET - SECONDS - 5))
((BENCH_T > 180)) && BENCH_T=180
# -j 1: the kernels are in TileLang's disk cache already; worker processes would only reload them
BENCH_ARGS=(--rows rest --out "$OUTDIR" --budget-s $((BENCH_T > 60 ? BENCH_T - 40 : 20)) --backward-share 0.4 -j 1 --presets "$BENCH_PRESETS")
[[ $DRY == 1 ]] && BENCH_ARGS+=(--dry-run)
stage "benchmark" 180 5 "${PY[@]}" bench/bench_gpu.py "${BENCH_ARGS[@]}" 2>&1 | grep -v "TileLang begins\|TileLang completes" > "$OUTDIR/bench.log"
BENCH_RC=${PIPESTATUS[0]}
grep -v "^|" "$OUTDIR/bench.log" | tail -n 5

# 10. the short table, last
{
  echo "# attngen GPU check$([[ $DRY == 1 ]] && echo ' (DRY RUN)')"
  echo
  echo "- build kernels: exit $BUILD_RC"
  echo "- smoke (one launch per preset): exit $SMOKE_RC${HUNG:+, hung: $HUNG}"
  echo "- benchmark goal rows (issues 29, 30): exit $GOAL_RC"
  echo "- pytest -m gpu: exit $TEST_RC, $(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUTDIR/pytest.log" | tail -n 1)"
  echo "- compute-sanitizer: exit $SAN_RC$([[ $DRY == 1 ]] && echo ' (dry run: not run)')"
  echo "- timeline$([[ $DRY == 1 ]] && echo ' (dry run: stamped build only)'): exit $TL_RC"
  echo "- benchmark: exit $BENCH_RC"
  echo "- serving benchmark: exit $SERVE_RC"
  echo "- total ${SECONDS} s"
  echo
  [[ -f "$OUTDIR/goals/bench.md" ]] && { grep -E '^(\||## |FAILED)' "$OUTDIR/goals/bench.md"; echo; }
  if [[ -f "$OUTDIR/bench.md" ]]; then
    grep '^- ' "$OUTDIR/bench.md"
    echo
    grep -E '^(\||\\\*|n/a|FAILED|## )' "$OUTDIR/bench.md"
  fi
  [[ -f "$OUTDIR/serving.md" ]] && { echo; grep -E '^(\||device copy)' "$OUTDIR/serving.md"; }
} > "$OUTDIR/summary.md"
echo
cat "$OUTDIR/summary.md"
((BUILD_RC == 0 && SMOKE_RC == 0 && GOAL_RC == 0 && TEST_RC == 0 && SAN_RC == 0 && TL_RC == 0 && BENCH_RC == 0 && SERVE_RC == 0))
