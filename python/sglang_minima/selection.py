"""Whether this process runs Minima-KV, and with which config (every hook checks this at run time)."""

from __future__ import annotations

from sglang_minima.config import MinimaConfig, get_active_config

MINIMA_BACKEND_NAME = "minima"
"""The radix-cache backend name that selects Minima (``--radix-cache-backend minima``)."""
MINIMA_NATIVE_BACKEND = "minima_native"
"""The torch attention backend (CPU, and the reference on CUDA): ``--attention-backend minima_native``."""
MINIMA_BACKEND = "minima"
"""The GPU attention backend (the fused kernels): ``--attention-backend minima``."""
MINIMA_ATTENTION_BACKENDS = (MINIMA_NATIVE_BACKEND, MINIMA_BACKEND)


def minima_selected() -> bool:
    """True when this SGLang process runs with Minima-KV (checked at run time by every hook)."""
    if get_active_config() is not None:
        return True
    try:
        from sglang.srt.runtime_context import get_memory  # here: this module imports without SGLang

        return get_memory().radix_cache_backend == MINIMA_BACKEND_NAME
    except Exception:  # server args not published in this process (yet)
        return False


def resolve_config() -> MinimaConfig:
    """The active config; defaults when Minima was selected by flag alone (e.g. ``sglang serve``)."""
    return get_active_config() or MinimaConfig()
