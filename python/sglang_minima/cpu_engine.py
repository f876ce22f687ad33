"""Set up SGLang's CPU engine for this process and the SGLang processes it spawns.

Must run before ``sglang`` is imported: SGLang reads SGLANG_USE_CPU_ENGINE and imports
``sgl_kernel`` helpers at module import time.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

SHIM_DIR = Path(__file__).resolve().parent / "_cpu" / "shim"


def setup_cpu_engine() -> None:
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    # On these small machines one OpenMP thread is far faster than oversubscribed spinning.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "sglang" in sys.modules:
        raise RuntimeError("setup_cpu_engine() must run before sglang is imported")
    if importlib.util.find_spec("sgl_kernel") is None:
        _use_sgl_kernel_shim()


def _use_sgl_kernel_shim() -> None:
    """Put the pure-torch ``sgl_kernel`` stand-in first on the path, here and in children."""
    shim = str(SHIM_DIR)
    if shim not in sys.path:
        sys.path.insert(0, shim)
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if shim not in parts:
        os.environ["PYTHONPATH"] = os.pathsep.join([shim, *parts])
