#!/usr/bin/env bash
# Create (or reuse) the project-local CPU environment in .venv: SGLang 0.5.23 with the CPU build of
# torch, this package (editable) and the test tools. Idempotent; safe to re-run.
# Usage: bash scripts/setup_env.sh            (VENV=path overrides .venv)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
STAMP="$VENV/.minima-env-v1"
if [ -f "$STAMP" ] && [ "$STAMP" -nt "$ROOT/scripts/setup_env.sh" ]; then
  exit 0
fi
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
"${PIP[@]}" -U pip "setuptools>=70" wheel
# SGLang pins torch 2.14.1 (a CUDA build, ~5.5 GB). On CPU the 2.13.0 CPU build is enough
# (~190 MB) and SGLang is installed --no-deps, with the runtime deps its CPU path imports.
"${PIP[@]}" "torch==2.13.0" "triton==3.9.0"
"${PIP[@]}" --no-deps "sglang==0.5.23" "torchvision==0.28.0"
"${PIP[@]}" "torch==2.13.0" \
  "transformers==5.19.0" "tokenizers==0.23.2" fastapi "uvicorn>=0.51" uvloop "pyzmq>=25.1.2" \
  orjson requests aiohttp psutil setproctitle pydantic "prometheus-client>=0.20.0" pybase64 \
  python-multipart partial_json_parser msgspec numpy pillow einops IPython \
  "apache-tvm-ffi==0.1.11" dill "sentencepiece==0.2.1" "compressed-tensors==0.18.0" "gguf==0.19.0" \
  "openai==2.8.0" jsonschema "xgrammar==0.2.7" "soundfile==0.13.1" "python-dateutil<3" datasets \
  accelerate pytest "hypothesis>=6.100" pytest-timeout tqdm matplotlib filelock
"${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"
# PyPI's torchvision needs its op schemas defined to import beside the CPU torch (SGLang imports it).
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import sglang_minima._cpu.torchvision_compat as m; m.install_hook()" > "$SITE/sglang_minima_cpu.pth"
touch "$STAMP"
