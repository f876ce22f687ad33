"""Start and stop a real ``python -m sglang_minima.launch_server`` on CPU for e2e tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests

STARTUP_TIMEOUT_S = 600


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
    cmd = [sys.executable, "-m", module, "--port", str(port), *args]
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
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
