"""Bad flags stop the launcher with one message naming the flag; nothing starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_minima.launch_server", "--port", "1", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, flag", [
    (["--minima-recent-pagez", "2"], "--minima-recent-pagez"),
    (["--minima-sink-pages", "-1"], "--minima-sink-pages"),
    (["--minima-fp8-page-fraction", "1.5"], "--minima-fp8-page-fraction"),
    (["--minima-hot-dtype", "int4"], "--minima-hot-dtype"),
    (["--speculative-algorithm", "NGRAM"], "--speculative-algorithm"),
    (["--enable-hierarchical-cache"], "--enable-hierarchical-cache"),
    (["--radix-cache-backend", "flexkv"], "--radix-cache-backend"),
    (["--attention-backend", "torch_native"], "--attention-backend"),
])
def test_bad_flag_names_the_flag(args, flag):
    out = _launch(*args)
    assert out.returncode == 2, out.stderr[-2000:]
    error_lines = [line for line in out.stderr.splitlines() if "error:" in line]
    assert error_lines and flag in error_lines[-1], out.stderr[-2000:]
    assert "Uvicorn running" not in out.stderr + out.stdout
