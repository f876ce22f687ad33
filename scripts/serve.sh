#!/usr/bin/env bash
# Set up the project environment (.venv, idempotent) and serve Minima-KV on CPU with the embedded
# default model (SmolLM2-135M-Instruct). Any SGLang or --minima-* flag may follow.
# Usage: bash scripts/serve.sh [--port 30000] [flags...]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
exec "$ROOT/.venv/bin/python" -m sglang_minima.launch_server --device cpu "$@"
