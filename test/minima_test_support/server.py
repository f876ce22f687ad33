"""Start and stop a real ``python -m sglang_minima.launch_server`` for e2e tests.

The device under test is CPU unless ``MINIMA_E2E_DEVICE`` says otherwise (the device harness,
scripts/device/env.sh, sets ``cuda``); ``MINIMA_E2E_SERVER_ARGS`` adds flags every server needs
there (the harness's torch sampling). The same tests run on both: only these flags differ.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests
from sglang_minima.config import CONFIG_ENV

STARTUP_TIMEOUT_S = 600
# What a GPU server gets beside the CPU launcher's own defaults: the same logical KV capacity.
_DEVICE_ARGS = {"cpu": [], "cuda": ["--device", "cuda", "--max-total-tokens", "32768", "--dtype", "bfloat16"]}


def e2e_device() -> str:
    device = os.environ.get("MINIMA_E2E_DEVICE", "cpu")
    if device not in _DEVICE_ARGS:
        raise ValueError(f"MINIMA_E2E_DEVICE must be one of {sorted(_DEVICE_ARGS)}, got {device!r}")
    return device


def device_args(args: list[str]) -> list[str]:
    """The device's flags (and MINIMA_E2E_SERVER_ARGS) that ``args`` does not set itself."""
    extra = _DEVICE_ARGS[e2e_device()] + shlex.split(os.environ.get("MINIMA_E2E_SERVER_ARGS", ""))
    given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    out, i = [], 0
    while i < len(extra):
        j = i + 1
        while j < len(extra) and not extra[j].startswith("--"):
            j += 1
        if extra[i].split("=", 1)[0] not in given:
            out += extra[i:j]
        i = j
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log_path: Path
    startup_s: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)


def launch(args: list[str], log_path: Path, env: dict[str, str] | None = None,
           module: str = "sglang_minima.launch_server", port: int | None = None) -> Server:
    """Launch a server (on ``port``, or a free one) and wait until /health answers (raises with the
    log tail if it dies)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", module, "--port", str(port), *args, *device_args(args)]
    # never an inherited Minima config (the plugin reads it in every SGLang process: a plain SGLang
    # server would tier its pages); sglang_minima.launch_server sets its own
    inherited = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    full_env = {**inherited, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    log = open(log_path, "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    server = Server(proc, port, log_path, 0.0)
    while time.time() - t0 < STARTUP_TIMEOUT_S:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-4000:]}")
        try:
            if requests.get(server.url + "/health", timeout=5).status_code == 200:
                server.startup_s = time.time() - t0
                return server
        except requests.RequestException:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"server did not start in {STARTUP_TIMEOUT_S}s:\n{server.log()[-4000:]}")
