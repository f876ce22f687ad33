#!/usr/bin/env bash
# One device call: (install the last stack part,) build all kernels in parallel, run the GPU tests,
# then the decode benchmark with what is left of the call. Logs and JSON go to $OUT.
#   usage (device): bash scripts/device/run_all.sh [install] [TEST_TIMEOUT_S] [BENCH_BUDGET_S]
#   TEST_GROUPS (env): '|'-separated pytest -k expressions, one process each (default: all tests)
#   BENCH=0 (env): tests only, no benchmark (instruction mix: scripts/kernel_sass.py, no GPU needed)
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${1:-}" = install ]; then shift; bash scripts/gpu-stack.sh install || exit 3; fi
export PYTHONPATH=/tmp/site:$PWD/kernels:$PWD/python:$PWD/test/gpu PYTHONUNBUFFERED=1
test_timeout=${1:-240}; bench_budget=${2:-200}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 scripts/device/warm_kernels.py ${WARM_ARGS:-} 2>&1 | tee "$OUT/warm.log" | grep -v "^\s*$" | tail -40
# three pytest processes: a CUDA error is sticky for its process, so one failing kernel must not
# take the other groups' results down with it
IFS="|" read -ra groups <<< "${TEST_GROUPS:-bit_identical or glue_rotations or split_combine|mixed_decode|all_fp8 or without_fp8 or long_context or more_splits_than_pages or single_request or fp8_build or fused}"
for group in "${groups[@]}"; do
  timeout "$test_timeout" python3 -m pytest test/gpu/test_kernels.py -k "$group" -v -s -p no:cacheprovider \
    --confcutdir=test/gpu -o addopts="" 2>&1 | tee -a "$OUT/tests.log" | grep -E "PASS|FAIL|ERROR|rel_err|differ|passed|failed|Error" | tail -30
done
[ "${BENCH:-1}" = 0 ] && exit 0
timeout $((bench_budget + 120)) python3 benchmark/kernels/bench_decode.py --out "$OUT/bench_decode.json" --budget-s "$bench_budget" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench.log" | tail -80
