"""``python -m sglang_minima.launch_server``: SGLang's launcher with Minima-KV selected.

Every SGLang flag works as with ``python -m sglang.launch_server``; ``--minima-*`` flags are split
off, validated into one MinimaConfig and carried to the scheduler process in the environment.
Unless the user chose otherwise, Minima's attention and radix-cache backends are selected; with
``--device cpu`` (or no CUDA) SGLang's CPU engine is set up; with no ``--model-path`` the embedded
default model (SmolLM2-135M-Instruct) is served. The attention backend is ``minima`` on CUDA (decode
through the fused kernels) and ``minima_native`` (torch) on CPU; on CUDA, what the kernels do not read
(hot pages in the model dtype: ``--minima-hot-dtype auto``; page scores for score Anchors:
``--minima-attention-score-anchors``; the observation window's page mass: ``--minima-anchor-window``;
Lloyd-Max or 4-bit values: ``--minima-value-code lloyd-max``, ``--minima-value-bits 4``)
selects ``minima_native``, and is refused with
``--attention-backend minima``. ``minima`` keeps SGLang's decode CUDA graphs (its plan is written
inside the graph); extend batches are planned on the host, so prefill graphs are off by default and
whole-forward ones (``full``) are refused. ``--cuda-graph-backend-prefill breakable`` is accepted
with ``minima``: SGLang's breakable graphs replay the layers between attention calls and run each
attention call, and the backend's ``init_forward_metadata`` before it, eagerly on the live batch, so
Minima's host-planned extend serves inside them (opt-in: with them the device e2e suite passes but
for the qwen3.6-27b-class geometry, out of GPU memory during their capture). Decode
graphs are off on ``minima_native``.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Sequence

from sglang_minima.config import (
    MinimaConfig,
    add_minima_cli_args,
    parse_minima_argv,
    set_active_config,
    split_minima_argv,
)
from sglang_minima.layers.attention import MINIMA_ATTENTION_BACKENDS, MINIMA_BACKEND, MINIMA_NATIVE_BACKEND

logger = logging.getLogger("sglang_minima.launch_server")

CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768
DEFAULT_PAGE_SIZE = 64


class LaunchError(SystemExit):
    """A bad flag or combination: one message naming the flag, exit status 2, nothing started."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(arg in ("-h", "--help") for arg in argv):
        print_help()
        return
    try:
        _, sglang_argv = prepare(argv)
        server_args = build_server_args(sglang_argv)
    except LaunchError as e:
        print(f"sglang_minima.launch_server: error: {e.message}", file=sys.stderr)
        raise
    from sglang.launch_server import run_server
    from sglang.srt.utils import kill_process_tree

    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def print_help(file=None) -> None:
    """``--help``: the ``--minima-*`` flags, then SGLang's own (all accepted), without fetching a model."""
    import argparse

    prog = "python -m sglang_minima.launch_server"
    minima = argparse.ArgumentParser(
        prog=prog, add_help=False, description="SGLang's server with Minima-KV: every SGLang flag (below), plus:"
    )
    add_minima_cli_args(minima)
    minima.print_help(file)
    if not _cuda_available() and "sglang" not in sys.modules:
        from sglang_minima.cpu_engine import setup_cpu_engine

        setup_cpu_engine()
    from sglang.srt.server_args import ServerArgs

    sglang = argparse.ArgumentParser(prog=prog, add_help=False)
    ServerArgs.add_cli_args(sglang)
    print("\nSGLang flags:", file=file)
    sglang.print_help(file)


def prepare(argv: Sequence[str]) -> tuple[MinimaConfig, list[str]]:
    """Everything before SGLang is imported: flags, CPU engine setup, default model."""
    minima_argv, sglang_argv = split_minima_argv(argv)
    config = parse_minima_argv(minima_argv)  # argparse exits 2 naming the bad flag
    if _flag_value(sglang_argv, "--device") is None and not _cuda_available():
        sglang_argv += ["--device", "cpu"]
    on_cpu = _flag_value(sglang_argv, "--device") == "cpu"
    if on_cpu:
        from sglang_minima.cpu_engine import setup_cpu_engine

        setup_cpu_engine()
    if _flag_value(sglang_argv, "--model-path", "--model") is None:
        from sglang_minima.models import ensure_default_model

        sglang_argv += ["--model-path", str(ensure_default_model())]
    _check_kernel_backend(config, sglang_argv, on_cpu)
    backend = _default_backend(config, on_cpu)
    decode_backend, prefill_backend = _phase_backends(sglang_argv, backend)
    _check_graphs(sglang_argv, decode_backend, prefill_backend)
    sglang_argv += _default_flags(sglang_argv, on_cpu, backend, decode_backend)
    set_active_config(config)
    return config, sglang_argv


def build_server_args(sglang_argv: list[str]):
    """Register the plugin in this process, parse SGLang's flags, reject unsupported combinations."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args

    from sglang_minima.plugin import register

    register()  # direct call: a broken plugin fails loudly here (load_plugins only logs)
    load_plugins()
    server_args = prepare_server_args(sglang_argv)
    check_supported(server_args)
    return server_args


# SGLang features that assume one uniform KV format per pool (see docs/ARCHITECTURE.md).
_UNSUPPORTED = (
    ("speculative_algorithm", "--speculative-algorithm", "speculative decoding"),
    ("enable_hierarchical_cache", "--enable-hierarchical-cache", "HiCache"),
    ("enable_lmcache", "--enable-lmcache", "LMCache"),
    ("enable_flexkv", "--enable-flexkv", "FlexKV"),
    ("enable_unified_cache_external_linker", "--enable-unified-cache-external-linker", "the external cache linker"),
    ("enable_kv_cache_sharding", "--enable-kv-cache-sharding", "KV-cache sharding"),
    ("disable_radix_cache", "--disable-radix-cache", "disabling the radix cache (Minima is a radix-cache backend)"),
)


ATTENTION_BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")
"""SGLang's flags that pick an attention backend: both phases, then each (one list for every check)."""


def check_supported(server_args) -> None:
    for attr, flag, what in _UNSUPPORTED:
        if getattr(server_args, attr, None):
            raise LaunchError(f"{flag}: {what} is not supported with Minima-KV")
    if (getattr(server_args, "disaggregation_mode", "null") or "null") != "null":
        raise LaunchError("--disaggregation-mode: PD disaggregation is not supported with Minima-KV")
    if (getattr(server_args, "dcp_size", 1) or 1) > 1:
        raise LaunchError("--dcp-size: decode context parallelism is not supported with Minima-KV")
    for flag in ATTENTION_BACKEND_FLAGS:
        backend = getattr(server_args, flag[2:].replace("-", "_"), None)
        if backend is not None and backend not in MINIMA_ATTENTION_BACKENDS:
            raise LaunchError(
                f"{flag}: Minima-KV's pages are read only by Minima's attention backends "
                f"({', '.join(MINIMA_ATTENTION_BACKENDS)}), got {backend!r}"
            )
    if server_args.radix_cache_backend != "minima":
        raise LaunchError(
            f"--radix-cache-backend: sglang_minima.launch_server serves Minima-KV, which needs "
            f"'minima', got {server_args.radix_cache_backend!r}"
        )
    from sglang_minima.codec.layout import CHUNK_TOKENS, page_size_fits  # after SGLang: the codec imports torch

    page_size = server_args.page_size
    if page_size is not None and not page_size_fits(page_size):
        raise LaunchError(
            f"--page-size: Minima-KV stores Stale pages as TQ3, whose pages hold whole {CHUNK_TOKENS}-token "
            f"tensor-core tiles; use a multiple of {CHUNK_TOKENS} (default {DEFAULT_PAGE_SIZE}), got {page_size}"
        )


def _kernel_limits(config: MinimaConfig) -> list[str]:
    """The ``--minima-*`` flags given that the ``minima`` (GPU kernel) backend cannot honour."""
    limits = []
    if config.hot_dtype != "fp8_e4m3":
        limits.append(f"--minima-hot-dtype {config.hot_dtype} (the kernels read FP8 hot pages)")
    if config.attention_score_anchors:
        limits.append("--minima-attention-score-anchors (the kernels collect no page scores)")
    if config.anchor_window:
        limits.append("--minima-anchor-window (the kernels collect no page mass)")
    # the page layout's options the kernels do not read: the list the backend and the conversions read
    # (imported here: the codec package imports torch, which this module does not at import time)
    from sglang_minima.codec.layout import kernel_unread_options

    return limits + kernel_unread_options(config.value_code, config.value_bits)


def _default_backend(config: MinimaConfig, on_cpu: bool) -> str:
    """``minima`` on CUDA, unless a flag needs the torch path; ``minima_native`` on CPU."""
    if on_cpu:
        return MINIMA_NATIVE_BACKEND
    if limits := _kernel_limits(config):
        logger.info("attention backend %s: %s", MINIMA_NATIVE_BACKEND, "; ".join(limits))
        return MINIMA_NATIVE_BACKEND
    return MINIMA_BACKEND


def _check_kernel_backend(config: MinimaConfig, argv: list[str], on_cpu: bool) -> None:
    """An explicit ``minima`` backend where it cannot serve, for either phase: one message naming the flags."""
    for flag in ATTENTION_BACKEND_FLAGS:
        if _flag_value(argv, flag) != MINIMA_BACKEND:
            continue
        if on_cpu:
            raise LaunchError(f"{flag} {MINIMA_BACKEND} runs the GPU kernels: on CPU use {MINIMA_NATIVE_BACKEND}")
        if limits := _kernel_limits(config):
            raise LaunchError(f"{flag} {MINIMA_BACKEND} cannot serve {'; '.join(limits)}: use {MINIMA_NATIVE_BACKEND}")


def _phase_backends(sglang_argv: Sequence[str], default: str) -> tuple[str, str]:
    """The attention backends (decode batches, extend batches) SGLang's flags give, ``default`` where they
    give none: what the pool's sizing charges for (the prefill's scratch, ``prefill_scratch_reserve``)
    follows them."""
    argv = list(sglang_argv)
    return _phase_backend(argv, "decode", default), _phase_backend(argv, "prefill", default)


def prefill_scratch_reserve_for(argv: Sequence[str], device: str, *, num_kv_heads: int, head_dim: int,
                                page_size: int) -> int:
    """Bytes a server launched with ``argv`` (Minima's and SGLang's flags, in their command line's order:
    the last of a repeated flag counts) on ``device`` (or the ``--device`` in ``argv``) keeps in its
    memory budget for the prefill's scratch (``extend_scratch_reserve``), without starting it: what a
    benchmark that sizes pools at one byte budget leaves out of Minima's pool (SGLang sizes a pool from
    its memory less this; a pool given by ``--max-total-tokens`` is taken as given). One GPU: tensor
    parallelism divides ``num_kv_heads``."""
    from sglang_minima.mem_cache.tier_store import extend_scratch_reserve  # (torch: imported when used)

    minima_argv, sglang_argv = split_minima_argv(argv)
    device = _flag_value(sglang_argv, "--device") or device
    _, prefill = _phase_backends(sglang_argv, _default_backend(parse_minima_argv(minima_argv), device == "cpu"))
    return extend_scratch_reserve(prefill, device, num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size)


def _phase_backend(argv: list[str], phase: str, default: str) -> str:
    """The backend ``phase`` ("decode" or "prefill") batches run on: the one given for it, else the
    one given for both, else ``default``."""
    return _flag_value(argv, f"--{phase}-attention-backend") or _flag_value(argv, "--attention-backend") or default


def _check_graphs(argv: list[str], backend: str, prefill_backend: str) -> None:
    """CUDA graphs asked for where Minima cannot be captured: extend batches captured whole (both
    backends plan them on the host; ``minima`` serves SGLang's breakable prefill graphs, whose
    attention calls run eagerly), and decode batches on ``minima_native`` (host page lists per
    step). The ``minima`` backend's decode is captured whole (``--cuda-graph-backend-decode full``)."""
    for flag in ("--cuda-graph-backend-decode", "--cuda-graph-backend-prefill"):
        value = _flag_value(argv, flag)
        if value in (None, "disabled") or (flag.endswith("decode") and backend == MINIMA_BACKEND and value == "full"):
            continue
        if flag.endswith("prefill") and prefill_backend == MINIMA_BACKEND and value == "breakable":
            continue
        if flag.endswith("prefill"):
            why = ("Minima plans extend and prefill batches on the host, which a whole-forward CUDA graph cannot "
                   f"capture; --attention-backend {MINIMA_BACKEND} serves breakable")
        elif backend == MINIMA_BACKEND:
            why = f"the {MINIMA_BACKEND} backend's decode is captured whole: use full"
        else:
            why = f"{backend} plans every decode step on the host; --attention-backend {MINIMA_BACKEND} captures decode"
        raise LaunchError(f"{flag} {value}: {why} (leave the flag out for the launcher's choice, or pass disabled)")


def _default_flags(argv: list[str], on_cpu: bool, backend: str, decode_backend: str) -> list[str]:
    defaults: list[tuple[tuple[str, ...], list[str]]] = [
        (("--attention-backend",), ["--attention-backend", backend]),
        (("--radix-cache-backend",), ["--radix-cache-backend", "minima"]),
        (("--page-size",), ["--page-size", str(DEFAULT_PAGE_SIZE)]),
    ]
    if on_cpu:
        defaults.append((("--max-total-tokens",), ["--max-total-tokens", str(CPU_DEFAULT_MAX_TOTAL_TOKENS)]))
    graphs_off = ("--disable-cuda-graph",)
    # Extend batches are planned on the host: no prefill graphs unless asked for (breakable, on
    # ``minima``: not the default while capturing them runs the qwen3.6-class e2e server out of memory). Decode graphs where the decode
    # backend captures them (``minima`` on CUDA: SGLang's default, full graphs), else none.
    defaults.append((("--cuda-graph-backend-prefill", *graphs_off), ["--cuda-graph-backend-prefill", "disabled"]))
    if on_cpu or decode_backend != MINIMA_BACKEND:
        defaults.append((("--cuda-graph-backend-decode", *graphs_off), ["--cuda-graph-backend-decode", "disabled"]))
    return [arg for names, flag in defaults if _flag_value(argv, *names) is None for arg in flag]


def _flag_value(argv: Sequence[str], *names: str) -> str | None:
    """The value given last for any of ``names`` (``--x v`` or ``--x=v``), or None if absent: SGLang's
    argparse keeps the last of a repeated flag, so the launcher reads the same one."""
    value = None
    for i, arg in enumerate(argv):
        for name in names:
            if arg == name:
                value = argv[i + 1] if i + 1 < len(argv) else ""
            elif arg.startswith(name + "="):
                value = arg.split("=", 1)[1]
    return value


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    main()
