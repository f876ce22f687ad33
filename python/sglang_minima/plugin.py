"""SGLang plugin entry point (``sglang.srt.plugins: minima = sglang_minima.plugin:register``).

SGLang calls ``register()`` through ``load_plugins()`` in the launcher and again inside every
spawned scheduler process, the one that owns the KV cache. Registration is idempotent and cheap:
it adds names to SGLang's registries and hooks that stay inert unless Minima is selected
(``--radix-cache-backend minima``, which ``sglang_minima.launch_server`` sets by default).

This module only wires things together: nothing in the package imports it (the launcher, the
other entry point, calls ``register()``). Whether Minima is selected lives in ``selection.py``.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import Any

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_minima.config import config_summary
from sglang_minima.hooks import install_memory_hooks
from sglang_minima.layers.attention import register_attention_backends
from sglang_minima.reporting.server_info import minima_server_info
from sglang_minima.selection import minima_selected, resolve_config

logger = logging.getLogger(__name__)

_registration: dict[str, Any] | None = None


def register() -> None:
    """Register Minima's backends and hooks with SGLang. Safe to call any number of times."""
    global _registration
    if _registration is not None:
        return
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


def _add_server_info(result, controller, *args, **kwargs):
    """AFTER hook on get_internal_state: the ``minima`` section of /server_info."""
    if not minima_selected():
        return None
    section = {
        "config": config_summary(resolve_config()),
        "plugin": {"registered": registration_info(), "reporting_pid": os.getpid()},
    }
    section.update(minima_server_info(controller.scheduler))
    result.internal_state["minima"] = section
    return result
