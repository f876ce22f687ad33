#!/usr/bin/env bash
# Set up the project environment (.venv, idempotent) and run the test suite on CPU:
# fast unit tests first, then the end-to-end tests that start real SGLang servers.
# GPU tests are marked and skipped here; run them on a GPU machine (see README).
# Usage: bash scripts/run_tests.sh [extra pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
.venv/bin/python -m pytest -m "not e2e" "$@"
# -s: the e2e timing lines ([e2e] ...); --durations: which tests a slower CI run spent its time in
.venv/bin/python -m pytest -m e2e --timeout 1800 -s --durations=15 "$@"
