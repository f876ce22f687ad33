"""Start and stop a real ``python -m sglang_minima.launch_server`` for e2e tests.

The device under test is CPU unless ``MINIMA_E2E_DEVICE`` says otherwise (the device harness,
scripts/device/env.sh, sets ``cuda``); ``MINIMA_E2E_SERVER_ARGS`` adds flags every server needs
there (the harness's torch sampling). The same tests run on both: only these flags differ.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import requests
from sglang_minima.config import CONFIG_ENV

STARTUP_TIMEOUT_S = 600
BIND_ATTEMPTS = 3
_UVICORN_STARTUP_FAILURE = 3  # uvicorn.config.STARTUP_FAILURE
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
    """A free port below the kernel's ephemeral range (SGLang's own helper for ports bound later). The
    server binds its HTTP port only after its scheduler is up, and an ephemeral port can be handed
    to another socket in between: CI once saw uvicorn fail to bind it (exit 3) while /health and
    SGLang's post-warmup /freeze_gc reached whatever listened there and timed out."""
    # imported here: the benchmarks import this module before they set SGLang's CPU engine up
    from sglang.srt.utils.network import get_free_port_below_ephemeral

    return get_free_port_below_ephemeral()


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
    log tail if it dies). A free port that another process binds first is replaced (uvicorn exits
    with 3 on a bind error), at most BIND_ATTEMPTS times."""
    for _ in range(1 if port else BIND_ATTEMPTS):
        server = _start(args, log_path, env, module, port or free_port())
        code = _wait_healthy(server)
        if code is None:
            return server
        port_taken = code == _UVICORN_STARTUP_FAILURE and "address already in use" in server.log()
        if not port_taken:
            break
        _kill_group(server)  # the scheduler and detokenizer of the attempt, before its log is reused
        server.log_path.replace(server.log_path.with_name(f"{server.log_path.name}.port-{server.port}-taken"))
    why = f" (port {server.port} is taken: uvicorn could not bind it)" if port_taken else ""
    raise RuntimeError(f"server exited with {code}{why}:\n{server.log()[-4000:]}")


def _start(args: list[str], log_path: Path, env: dict[str, str] | None, module: str, port: int) -> Server:
    cmd = [sys.executable, "-m", module, "--port", str(port), *args, *device_args(args)]
    # never an inherited Minima config (the plugin reads it in every SGLang process: a plain SGLang
    # server would tier its pages); sglang_minima.launch_server sets its own
    inherited = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    full_env = {**inherited, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
    return Server(proc, port, log_path, 0.0)


def _kill_group(server: Server) -> None:
    try:
        os.killpg(server.process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _wait_healthy(server: Server) -> int | None:
    """None once /health answers 200 (startup_s set), the exit code if the server died first."""
    t0 = time.time()
    while time.time() - t0 < STARTUP_TIMEOUT_S:
        if server.process.poll() is not None:
            return server.process.returncode
        try:
            # (and still running: a 200 from another listener on the port is not this server)
            if requests.get(server.url + "/health", timeout=5).status_code == 200 and server.process.poll() is None:
                server.startup_s = time.time() - t0
                return None
        except requests.RequestException:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"server did not start in {STARTUP_TIMEOUT_S}s:\n{server.log()[-4000:]}")
