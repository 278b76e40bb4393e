#!/usr/bin/env bash
# One prepared run for a lent GPU machine (no network there). GPU time is scarce, so every
# step is bounded and the benchmark comes first. Needs python with torch and triton only
# (no numpy, matplotlib or pytest: each is used when present).
#   1. preflight, seconds: python, torch, triton, GPU name; qlab importable without
#      installing (if `import qlab.kernels` fails: pip install -e with no network, else a
#      PYTHONPATH overlay that maps qlab.kernels to kernels/)
#   2. the benchmark, --quick (FULL=1: every shape and M), under `timeout`, each shape in its
#      own process (SHAPE_TIMEOUT each): it checks every output against qlab before timing
#      it, appends every row to a JSON-lines file the moment it is done and rewrites its
#      JSON after every shape, so a timeout, an error or a CUDA fault keeps what was
#      measured. GPU: results/bench_<GPU>_<date>.json and .jsonl (+ 2 PNGs with matplotlib).
#   3. the kernel correctness tests natively, under their own timeout (with pytest)
#   4. this session's results and logs copied to $OUT when it is set (the device tool), always
# Exit code: the benchmark's when it failed (124: timed out), else the tests' (0: all good).
# Rehearse on any CPU: `bash benchmarks/gpu_session.sh`. With numpy, the benchmark checks
# every candidate on the Triton interpreter (no timing) and writes the roofline model;
# without numpy (Triton's interpreter needs it) qlab.kernels loads with TRITON_INTERPRET=0,
# as on a GPU. Either way it then counts the quick run's work (bench --plan; AOT=1 also
# compiles every kernel of it for sm_90 and measures the compilation).
#   BENCH_TIMEOUT=300 SHAPE_TIMEOUT=150 TEST_TIMEOUT=240 FULL=1 PY=python3 OUT=dir NO_PIP=1
#   AOT=1 SKIP_BENCH=1 TEST_K=expr  (all optional; NO_PIP=1 goes straight to the PYTHONPATH
#   overlay; SKIP_BENCH=1 and TEST_K, pytest's -k, rerun some tests in a few seconds)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
RUN_DIR=$REPO  # where python runs: the repo, or the overlay (whose qlab/ must come first)
PY=${PY:-python3}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
SHAPE_TIMEOUT=${SHAPE_TIMEOUT:-150}
TEST_TIMEOUT=${TEST_TIMEOUT:-240}
LOGS=${SESSION_DIR:-$(mktemp -d /tmp/qlab_gpu_session.XXXX)}
mkdir -p "$LOGS"
STAMP=$(mktemp /tmp/qlab_gpu_session_started.XXXX)  # results newer than this are this session's
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
QLAB_GIT_COMMIT=${QLAB_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
export QLAB_GIT_COMMIT
bench_rc=0
tests_rc=0
say() { echo "[gpu_session $(date +%H:%M:%S)] $*" | tee -a "$LOGS/session.log"; }

overlay=
copy_out() {
  [ -n "$overlay" ] && rm -rf "$overlay"
  if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT"
    cp -r "$LOGS"/. "$OUT"/ 2>/dev/null
    # this session's results only, not the ones committed before it
    find "$REPO"/results -maxdepth 1 -name 'bench_*' -newer "$STAMP" \
      -exec cp {} "$OUT"/ \; 2>/dev/null
    say "copied results and logs to $OUT"
  fi
  rm -f "$STAMP"
}
trap copy_out EXIT

# ---------------------------------------------------------------------------- 1. preflight
# Without a GPU and without numpy, Triton's interpreter cannot load: build-only kernels.
if ! timeout 120 "$PY" -c "import numpy" >/dev/null 2>&1 && \
    ! timeout 120 "$PY" -c "import torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  export TRITON_INTERPRET=0
fi
if ! timeout 120 "$PY" -c "import qlab.kernels" >/dev/null 2>&1; then
  say "qlab.kernels not importable: trying pip install -e (no network, no build isolation)"
  if [ -n "${NO_PIP:-}" ] || ! timeout 120 "$PY" -m pip install -q --no-deps \
      --no-build-isolation --no-index -e . >"$LOGS/pip.log" 2>&1; then
    overlay=$(mktemp -d /tmp/qlab_overlay.XXXX)
    mkdir "$overlay/qlab"
    for entry in "$REPO"/qlab/*; do ln -s "$entry" "$overlay/qlab/"; done
    ln -s "$REPO/kernels" "$overlay/qlab/kernels"  # the mapping pyproject's package-dir makes
    export PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}"
    RUN_DIR=$overlay  # python puts its working directory first on sys.path
    say "pip failed or skipped (pip.log): using the PYTHONPATH overlay $overlay"
  fi
fi
cd "$RUN_DIR" || exit 1
timeout 120 "$PY" - >"$LOGS/preflight.txt" 2>&1 <<'EOF'
import importlib.util, platform
import torch, triton
import qlab.kernels as qk
have = {m: importlib.util.find_spec(m) is not None for m in ("matplotlib", "pytest", "numpy")}
gpu = torch.cuda.get_device_name() if qk.HAS_CUDA else "none"
print(f"python {platform.python_version()} torch {torch.__version__} triton {triton.__version__}")
print(f"gpu {gpu}; interpreter {qk.INTERPRET}; modules {have}")
print("FLAGS", int(qk.HAS_CUDA and not qk.INTERPRET), int(have["matplotlib"] and have["numpy"]),
      int(have["pytest"]), int(qk.INTERPRET))
EOF
preflight_rc=$?
cat "$LOGS/preflight.txt" | tee -a "$LOGS/session.log"
if [ $preflight_rc -ne 0 ]; then
  say "PREFLIGHT FAILED (exit $preflight_rc): nothing else runs"
  exit $preflight_rc
fi
read -r _ native have_mpl have_pytest interpret < <(grep '^FLAGS' "$LOGS/preflight.txt")

# ---------------------------------------------------------------------------- 2. benchmark
mode=--quick
[ -n "${FULL:-}" ] && mode=
plots=
[ "$have_mpl" = 1 ] || plots=--no-plots
out_dir=$REPO/results
if [ -n "${SKIP_BENCH:-}" ]; then
  say "SKIP_BENCH is set: no benchmark"
elif [ "$native" = 1 ]; then
  say "benchmark $mode (timeout ${BENCH_TIMEOUT}s, ${SHAPE_TIMEOUT}s per shape)"
  timeout -k 10 "$BENCH_TIMEOUT" "$PY" -m qlab.kernels.bench $mode $plots --out "$out_dir" \
    --shape-timeout "$SHAPE_TIMEOUT" 2>&1 | tee "$LOGS/bench.log"
  bench_rc=${PIPESTATUS[0]}
  say "benchmark exit code $bench_rc"
else
  out_dir="$LOGS/cpu_rehearsal"  # the interpreter's checks and the model stay out of results/
  if [ "$interpret" = 1 ]; then
    say "no GPU: the benchmark checks every candidate on the interpreter, without timing"
    timeout -k 10 "$BENCH_TIMEOUT" "$PY" -m qlab.kernels.bench $mode $plots --out "$out_dir" \
      2>&1 | tee "$LOGS/bench.log"
    bench_rc=${PIPESTATUS[0]}
    say "benchmark exit code $bench_rc"
  fi
  aot=
  [ -n "${AOT:-}" ] && aot=--aot
  say "no GPU: the quick run's work, counted (bench --quick --plan $aot)"
  timeout -k 10 "$BENCH_TIMEOUT" "$PY" -m qlab.kernels.bench --quick --plan $aot \
    2>&1 | tee "$LOGS/plan.log"
  plan_rc=${PIPESTATUS[0]}
  [ "$bench_rc" -eq 0 ] && bench_rc=$plan_rc
  say "plan exit code $plan_rc"
fi

# ---------------------------------------------------------------------------- 3. tests
if [ "$have_pytest" != 1 ]; then
  say "pytest is not installed: kernel tests skipped"
elif [ "$native" != 1 ] && [ "$interpret" != 1 ]; then
  say "no GPU and no interpreter (numpy is missing): kernel tests skipped"
else
  say "kernel correctness tests (timeout ${TEST_TIMEOUT}s; default configs, no autotuning)"
  QLAB_AUTOTUNE=0 timeout -k 10 "$TEST_TIMEOUT" "$PY" -m pytest -q -p no:cacheprovider \
    ${TEST_K:+-k "$TEST_K"} "$REPO"/tests/kernels/test_kernel_{w4a16,fp8,dequant,configs,safety}.py \
    "$REPO"/tests/kernels/test_w4a16_decode.py \
    2>&1 | tee "$LOGS/kernel_tests.log"
  tests_rc=${PIPESTATUS[0]}
  say "tests exit code $tests_rc"
fi

if [ "$bench_rc" -ne 0 ]; then
  say "BENCHMARK FAILED"
  exit "$bench_rc"
fi
exit "$tests_rc"
