"""sha256 of the CUDA source TileLang generates for every minima_kernels kernel, no GPU needed.

A refactor that only moves kernel code must leave every line of this output unchanged: run it
before and after (``git worktree add /tmp/before HEAD~`` for "before") and diff. It lowers each
kernel for sm_90a (``tilelang.engine.lower``, no nvcc) over the builds the compile tests use.

    python scripts/kernel_sources.py [--out sources_dir]   # one "name sha256" line per build

Needs tilelang (the gpu extra); flashinfer is not needed (a stand-in module is used when absent).
Run it with a fixed PYTHONHASHSEED: TileLang's lowering of some kernels (barrier placement,
workspace names) follows Python's hash order, so two runs with random seeds can differ; the
warp-specialized FP8 decode's lowering differs between runs even with a fixed seed. ``--tir``
hashes what the kernel functions themselves build (the TIR before TileLang's passes), which is
deterministic.
"""

import argparse
import hashlib
import importlib
import math
import pkgutil
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "kernels"), str(ROOT / "python")]
try:
    import flashinfer  # noqa: F401
except ImportError:  # only the wrapper's run() calls it
    sys.modules["flashinfer"] = types.ModuleType("flashinfer")

import minima_kernels  # noqa: E402
import torch  # noqa: E402
from sglang_minima.codec import tq3_codebook  # noqa: E402
from sglang_minima.codec.rotation import fp32_inv_sqrt  # noqa: E402
from tilelang import tvm  # noqa: E402
from tilelang.engine import lower  # noqa: E402
from tilelang.transform.pass_config import normalize_pass_configs  # noqa: E402
from tilelang.backend.target import determine_target  # noqa: E402

SM90A = {"kind": "cuda", "arch": "sm_90a"}
GEOMETRIES = [(24, 4, 256, 64), (32, 8, 128, 32), (9, 3, 64, 16)]


def find(name: str):
    """``name`` from minima_kernels or any of its modules (so the script reads old and new layouts)."""
    if hasattr(minima_kernels, name):
        return getattr(minima_kernels, name)
    for info in pkgutil.iter_modules(minima_kernels.__path__):
        module = importlib.import_module(f"minima_kernels.{info.name}")
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(name)


def builds():
    """(label, jit function, args, kwargs) for every kernel and build the compile tests cover."""
    tile_config, fused_build_of, fp8_tile_config = find("tile_config"), find("fused_build_of"), find("fp8_tile_config")
    key_centroids_fp16 = find("key_centroids_fp16")
    for hq, h, d, p in GEOMETRIES:
        g, tag = hq // h, f"{hq}q{h}kv{d}d{p}p"
        cent = key_centroids_fp16(d)
        for batch in (None, 1):
            config = tile_config(g, p, d, batch)
            yield f"tq3_decode/{tag}/b{batch}", find("tq3_decode_kernel"), (h, g, d, p, d**-0.5, cent), config
            for q_dtype in ("bfloat16", "float16"):
                yield (f"mixed_decode/{tag}/b{batch}/{q_dtype}", find("mixed_decode_kernel"),
                       (h, g, d, p, d**-0.5, cent, q_dtype), fused_build_of(config, p))
        yield f"tq3_merge_splits/{tag}", find("tq3_merge_splits"), (hq, d), {}
        yield f"rotate_queries/{tag}", find("rotate_queries_kernel"), (hq, g, d, "bfloat16"), {}
        for state in find("FP8_STATES"):
            yield f"mixed_epilogue/{tag}/{state}", find("mixed_epilogue_kernel"), (hq, g, d, state, "bfloat16"), {}
        fp8 = fp8_tile_config(p)
        yield f"fp8_decode/{tag}", find("fp8_decode_kernel"), (h, g, d, p, d**-0.5, "bfloat16"), fp8
        if d <= 128:
            yield f"fp8_decode/{tag}/2pages", find("fp8_decode_kernel"), (h, g, d, p, d**-0.5, "bfloat16"), {**fp8, "pages_per_step": 2}
        book = tq3_codebook(d)
        c = tuple(float(x) for x in book.centroids)
        t = tuple(float(x) for x in book.thresholds)
        sqrt_d = float(torch.tensor(math.sqrt(d), dtype=torch.float32))
        yield f"fp8_to_tq3/{tag}", find("fp8_to_tq3_kernel"), (h, p, d, c, t, fp32_inv_sqrt(d), sqrt_d), {}
        yield f"tq3_to_fp8/{tag}", find("tq3_to_fp8_kernel"), (h, p, d, c, fp32_inv_sqrt(d)), {}


def source(jit_fn, args, kwargs) -> str:
    """What ``tilelang.compile`` hands nvcc: the same lowering, pass configs and target, no compile."""
    tir = jit_fn.get_tir(*args, **kwargs)
    target = determine_target(SM90A, return_object=True)
    with tvm.transform.PassContext(opt_level=3, config=normalize_pass_configs(jit_fn.pass_configs)), target:
        return lower(tir, target=target).kernel_source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="also write each build's source here")
    ap.add_argument("--only", default="", help="builds whose label contains this")
    ap.add_argument("--tir", action="store_true", help="hash the TIR the kernel functions build (before lowering)")
    args = ap.parse_args()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    for label, fn, a, kw in builds():
        if args.only not in label:
            continue
        src = fn.get_tir(*a, **kw).script() if args.tir else source(fn, a, kw)
        print(label, hashlib.sha256(src.encode()).hexdigest(), flush=True)
        if args.out:
            (args.out / (label.replace("/", "_") + ".cu")).write_text(src)


if __name__ == "__main__":
    main()
