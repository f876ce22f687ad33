#!/usr/bin/env bash
# Kernel tests and the decode benchmark in one device call, after `harness.sh install`: build all
# kernels in parallel, run the GPU kernel tests, then the benchmark with what is left of the call.
# Logs, JUnit XML and JSON go to $OUT.
#   usage (device): bash scripts/device/run_all.sh [TEST_TIMEOUT_S] [BENCH_BUDGET_S]
#   TEST_GROUPS (env): '|'-separated pytest -k expressions, one process each (default: all tests)
#   BENCH=0 (env): tests only, no benchmark (instruction mix: scripts/kernel_sass.py, no GPU needed)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
. scripts/device/env.sh
export PYTHONPATH=$PWD/test/gpu:$PYTHONPATH
test_timeout=${1:-240}; bench_budget=${2:-200}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 scripts/device/warm_kernels.py ${WARM_ARGS:-} 2>&1 | tee "$OUT/warm.log" | grep -v "^\s*$" | tail -40
# one pytest process per group: a CUDA error is sticky for its process, so one failing kernel must
# not take the other groups' results down with it
IFS="|" read -ra groups <<< "${TEST_GROUPS:-bit_identical or glue_rotations or split_combine|mixed_decode|all_fp8 or without_fp8 or long_context or more_splits_than_pages or single_request or fp8_build or fused or compile_builds}"
for i in "${!groups[@]}"; do
  timeout -s INT "$test_timeout" python3 -m pytest test/gpu/test_kernels.py -k "${groups[$i]}" -v -s -p no:cacheprovider \
    --confcutdir=test/gpu -o addopts="" --junitxml "$OUT/junit_kernels_$i.xml" 2>&1 | tee -a "$OUT/tests.log" \
    | grep -E "PASS|FAIL|ERROR|rel_err|differ|passed|failed|Error" | tail -30
done
[ "${BENCH:-1}" = 0 ] && exit 0
timeout $((bench_budget + 120)) python3 benchmark/kernels/bench_decode.py --out "$OUT/bench_decode.json" --budget-s "$bench_budget" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench.log" | tail -80
