"""Minima attention backends and their registration with SGLang.

``minima_native``: torch, CPU and reference (minima_native_backend.py), planned by plan.py and
forward_plan.py. ``minima``: the same plan, decode through the fused GPU kernels (minima_backend.py).
SGLang is imported only when registering, so plan.py stays importable (and testable) on its own.
"""

from __future__ import annotations

from sglang_minima.selection import MINIMA_ATTENTION_BACKENDS, MINIMA_BACKEND, MINIMA_NATIVE_BACKEND

__all__ = ["MINIMA_ATTENTION_BACKENDS", "MINIMA_BACKEND", "MINIMA_NATIVE_BACKEND", "register_attention_backends"]


def register_attention_backends() -> None:
    """Add Minima's backends to SGLang's attention registry and ``--attention-backend`` choices.

    Idempotent: the registry is a dict (re-registering rebinds the same factory) and the choices
    list is extended only when the name is missing (``add_attention_backend_choices`` is a bare
    ``list.extend`` and would append duplicates). Must run before ServerArgs is parsed.
    """
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    register_attention_backend(MINIMA_NATIVE_BACKEND)(_create_minima_native_backend)
    register_attention_backend(MINIMA_BACKEND)(_create_minima_backend)
    missing = [name for name in MINIMA_ATTENTION_BACKENDS if name not in ATTENTION_BACKEND_CHOICES]
    if missing:
        add_attention_backend_choices(missing)


def _create_minima_native_backend(runner):
    from sglang_minima.layers.attention.minima_native_backend import MinimaNativeAttnBackend

    return MinimaNativeAttnBackend(runner)


def _create_minima_backend(runner):
    from sglang_minima.layers.attention.minima_backend import MinimaAttnBackend

    return MinimaAttnBackend(runner)
