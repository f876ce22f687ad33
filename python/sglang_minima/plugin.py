"""SGLang plugin entry point (``sglang.srt.plugins: minima = sglang_minima.plugin:register``).

SGLang calls ``register()`` through ``load_plugins()`` in the launcher and again inside every
spawned scheduler process, the one that owns the KV cache. Registration is idempotent and cheap:
it adds names to SGLang's registries and hooks that stay inert unless Minima is selected
(``--radix-cache-backend minima``, which ``sglang_minima.launch_server`` sets by default).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import Any

from sglang_minima.config import MinimaConfig, config_summary, get_active_config

logger = logging.getLogger(__name__)

MINIMA_BACKEND_NAME = "minima"

_registration: dict[str, Any] | None = None


def register() -> None:
    """Register Minima's backends and hooks with SGLang. Safe to call any number of times."""
    global _registration
    if _registration is not None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_minima.layers.attention import register_attention_backends
    from sglang_minima.mem_cache.hooks import install_memory_hooks

    register_attention_backends()
    install_memory_hooks()
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state."
        "SchedulerInternalStateController.get_internal_state",
        _add_server_info,
        HookType.AFTER,
    )
    _registration = {"pid": os.getpid(), "process": multiprocessing.current_process().name}
    logger.debug("sglang_minima registered in pid %d", os.getpid())


def registration_info() -> dict[str, Any] | None:
    """Where register() ran in this process (pid, process name), or None if it has not."""
    return _registration


def minima_selected() -> bool:
    """True when this SGLang process runs with Minima-KV (checked at run time by every hook)."""
    if get_active_config() is not None:
        return True
    try:
        from sglang.srt.runtime_context import get_memory

        return get_memory().radix_cache_backend == MINIMA_BACKEND_NAME
    except Exception:  # server args not published in this process (yet)
        return False


def resolve_config() -> MinimaConfig:
    """The active config; defaults when Minima was selected by flag alone (e.g. ``sglang serve``)."""
    return get_active_config() or MinimaConfig()


def _add_server_info(result, controller, *args, **kwargs):
    """AFTER hook on get_internal_state: the ``minima`` section of /server_info."""
    if not minima_selected():
        return None
    from sglang_minima.mem_cache.server_info import minima_server_info

    section = {
        "config": config_summary(resolve_config()),
        "plugin": {"registered": registration_info(), "reporting_pid": os.getpid()},
    }
    section.update(minima_server_info(controller.scheduler))
    result.internal_state["minima"] = section
    return result
