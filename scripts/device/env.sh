# Source in every device call after `harness.sh install`: the environment of the device harness.
#   . scripts/device/env.sh
# Code is read from this working tree (python/, kernels/); /tmp/site holds what the bundle brought;
# /tmp/minima-dist holds only this package's metadata, so SGLang's plugin loader finds the
# `sglang.srt.plugins` entry point in every process it spawns.
_minima_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
export PYTHONPATH="$_minima_root/scripts/device/standin:$_minima_root/python:$_minima_root/kernels:/tmp/minima-dist:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
# The Rust radix-tree core reads torch 2.11's int64 tensors as Double: use SGLang's Python core.
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
# flashinfer JIT-compiles its kernels into $FLASHINFER_WORKSPACE_BASE/.cache: keep them on /tmp, where a
# warm machine keeps them from one call to the next (the `tests` phase warms them for `serve`).
export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-home
# TileLang's disk cache: importing sglang points it at ~/.cache/sglang/tilelang unless set, and
# warm_kernels.py (no sglang import) would fill ~/.tilelang/cache: one directory for both, so the
# servers load what the warm-up built instead of compiling it again (~16 s of nvcc per server).
export TILELANG_CACHE_DIR=/tmp/tilelang-cache
# The bundle's wheelhouse (the default model, RULER's generator): pip takes those from there only.
export SGLANG_MINIMA_WHEELHOUSE=/tmp/minima-bundle/wheelhouse
export SGLANG_MINIMA_CACHE=/tmp/minima-cache HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
# The stand-in has no sampling kernels: every server the harness starts samples in torch.
export MINIMA_E2E_DEVICE=cuda MINIMA_E2E_SERVER_ARGS="--sampling-backend pytorch"
python3 - "$_minima_root" <<'PY'
import pathlib, sys, tomllib
root = pathlib.Path(sys.argv[1])
project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
dist = pathlib.Path("/tmp/minima-dist") / f"sglang_minima-{project['version']}.dist-info"
dist.mkdir(parents=True, exist_ok=True)
(dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
(dist / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) for group, eps in project["entry-points"].items()))
PY
unset _minima_root
