#!/usr/bin/env bash
# One prepared run for a lent GPU machine (no network there): install this checkout
# without fetching anything, run the kernel tests natively, then the benchmark harness.
# Results land in results/ (commit the bench_*.json and PNGs) and, where $OUT is set
# (the device tool), are copied there too. About 3-5 minutes on an H100/H200.
#   bash benchmarks/gpu_session.sh            # --quick harness
#   FULL=1 bash benchmarks/gpu_session.sh     # every shape, M = 1..4096
set -uo pipefail
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
$PY -m pip install -q --no-deps --no-build-isolation --no-index -e . || exit 1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
mkdir -p results
# the kernel tests natively (the exercise tests need nbformat/nbclient: not on that image)
$PY -m pytest -q -p no:cacheprovider tests/kernels --ignore=tests/kernels/test_kernel_exercises.py \
  2>&1 | tee results/gpu_kernel_tests.log
QUICK=--quick
[ -n "${FULL:-}" ] && QUICK=
$PY -m qlab.kernels.bench $QUICK --out results 2>&1 | tee results/gpu_bench.log
if [ -n "${OUT:-}" ]; then
  cp results/bench_*.json results/bench_*.png results/gpu_*.log "$OUT"/ 2>/dev/null
fi
