"""SASS of the TQ3 decode kernel without a GPU: registers, spills and the main loop's instruction mix.

TileLang lowers the kernel for sm_90a here, nvcc compiles its CUDA source to a cubin and cuobjdump
disassembles it, so a change to the decode can be weighed in instructions per 16-token chunk before
any device time is spent (docs/results/kernels.md quotes these counts).

    python scripts/kernel_sass.py 24/4/256 [--page 64] [--set warps=12 --set shift_by_imad=1] [--sass out.sass]
    python scripts/kernel_sass.py 24/4/256 --fused     # mixed_decode_kernel: its TQ3 and FP8 roles' loops
    python scripts/kernel_sass.py 32/8/128 --key-bits 4 --key-center   # the server's key format, page-centered

Needs tilelang (the gpu extra), nvcc, and cuobjdump with nvdisasm (on PATH, or
``pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm``).
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "kernels"), str(ROOT / "python")]

import tilelang
from minima_kernels import tile_config, tq3_decode_kernel
from minima_kernels.common import key_centroids_fp16
from minima_kernels.heuristics import fused_build_of
from minima_kernels.mixed_decode import mixed_decode_kernel

SM90A = {"kind": "cuda", "arch": "sm_90a"}
INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);")


def cuda_tool(name: str) -> str:
    """``name`` from PATH or from NVIDIA's pip wheels (nvidia/cu*/bin)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import nvidia

        for base in nvidia.__path__:
            for candidate in Path(base).glob(f"cu*/bin/{name}"):
                return str(candidate)
    except ImportError:
        pass
    raise SystemExit(f"{name} not found: put it on PATH or `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`")


def cuobjdump(cubin: Path, flag: str) -> str:
    env = {**os.environ, "NVDISASM_PATH": str(Path(cuda_tool("nvdisasm")).parent)}
    done = subprocess.run([cuda_tool("cuobjdump"), flag, cubin], capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise SystemExit(f"cuobjdump {flag} failed: {done.stderr.strip()}")
    return done.stdout


def build_options(heads: str, page: int, options: dict, fused: bool = False, key_bits: int = 3,
                  key_center: bool = False) -> dict:
    """tile_config's build (with the FP8 role's, ``fused``: the library's mixed_decode_kernel) under ``options``."""
    hq, h, d = (int(x) for x in heads.split("/"))
    build = tile_config(hq // h, page, d, None, key_bits, key_center)
    return {**(fused_build_of(build, page) if fused else build), **options}


def build_cubin(heads: str, page: int, options: dict, workdir: Path, fused: bool = False, key_bits: int = 3,
                key_center: bool = False) -> Path:
    hq, h, d = (int(x) for x in heads.split("/"))
    build = build_options(heads, page, options, fused, key_bits, key_center)
    jit = mixed_decode_kernel if fused else tq3_decode_kernel
    center = {"key_center": True} if key_center else {}
    tir = jit.get_tir(h, hq // h, d, page, d**-0.5, key_centroids_fp16(d, key_bits), *(("bfloat16",) if fused else ()),
                      **build, **center)
    kernel = tilelang.compile(tir, target=SM90A, execution_backend="tvm_ffi", pass_configs=jit.pass_configs)
    source = workdir / "tq3_decode.cu"
    source.write_text(kernel.get_kernel_source())
    tl = Path(tilelang.__file__).parent
    cubin = workdir / "tq3_decode.cubin"
    includes = [f"-I{tl / 'src'}", f"-I{tl / '3rdparty' / 'cutlass' / 'include'}"]
    subprocess.run(["nvcc", "-arch=sm_90a", "-cubin", "-O3", "-std=c++17", "-w", *includes, "-o", cubin, source], check=True)
    return cubin


def main_loops(sass: str) -> list[list[str]]:
    """Instructions of each innermost loop that holds HMMAs (the step loops: one per role), in code order."""
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in map(INSTRUCTION.match, sass.splitlines()) if m]
    mmas = [a for a, text in code if "HMMA" in text]
    loops = []
    for addr, text in code:
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and "DIV" not in text and any(int(target.group(1), 16) <= a <= addr for a in mmas):
            loops.append((int(target.group(1), 16), addr))
    innermost = []  # the shortest loops first, each disjoint from those taken (ptxas rotates loops: outer ones overlap)
    for lo, hi in sorted(loops, key=lambda x: x[1] - x[0]):
        if all(hi < a or b < lo for a, b in innermost):
            innermost.append((lo, hi))
    return [[text for addr, text in code if lo <= addr <= hi] for lo, hi in sorted(innermost)]


def role_loops(sass: str, roles: int) -> list[list[str]]:
    """The step loops of the TQ3 role and (``roles`` 2: mixed_decode_kernel) the FP8 role, in that
    order: the FP8 role's is the one of e4m3 -> fp16 conversions (F2FP; the TQ3 loop's few pack p)."""
    return sorted(main_loops(sass)[:roles], key=lambda loop: sum(opcode(t) == "F2FP" for t in loop))


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("heads", help="query heads / kv heads / head dim, e.g. 24/4/256")
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=INT", help="build option over tile_config")
    ap.add_argument("--sass", help="also write the whole disassembly here")
    ap.add_argument("--fused", action="store_true", help="mixed_decode_kernel (TQ3 and FP8 roles) instead of the TQ3 decode")
    ap.add_argument("--key-bits", type=int, default=3, choices=(3, 4), help="the key code width (--minima-key-bits)")
    ap.add_argument("--key-center", action="store_true", help="page-centered keys (--minima-key-center)")
    args = ap.parse_args()
    options = {k: int(v) for k, v in (s.split("=", 1) for s in args.set)}
    with tempfile.TemporaryDirectory() as tmp:
        cubin = build_cubin(args.heads, args.page, options, Path(tmp), args.fused, args.key_bits, args.key_center)
        sass = cuobjdump(cubin, "-sass")
        usage = cuobjdump(cubin, "-res-usage")
    if args.sass:
        Path(args.sass).write_text(sass)
    resources = re.search(r"REG:\d+ STACK:\d+ SHARED:\d+ LOCAL:\d+", usage)
    print(f"{args.heads} page {args.page} {options or ''}: {resources.group(0) if resources else usage.strip()}")
    build = build_options(args.heads, args.page, options, args.fused, args.key_bits, args.key_center)
    roles = [("TQ3", build["step_chunks"]), ("FP8", build.get("fp8_step_chunks", 0))][: 2 if args.fused else 1]
    for (role, chunks), loop in zip(roles, role_loops(sass, len(roles)), strict=True):
        counts = collections.Counter(opcode(t) for t in loop)
        print(f"{role} main loop (one softmax step of {chunks} 16-token chunks per warp): {len(loop)} instructions, {len(loop) / chunks:.0f} per chunk")
        print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common()))


if __name__ == "__main__":
    main()
