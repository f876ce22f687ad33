"""One eager launch of each TQ3 decode build variant named on the command line (default: the
library build), per geometry, at batch 8 x 32K, 75% Stale: the workload Nsight Compute profiles.

    ncu -k regex:tq3_decode --section WarpStateStats ... python3 scripts/device/profile_tq3.py [variant ...]
"""

import sys

import torch

sys.path.insert(0, "benchmark/kernels")
from bench_decode import GEOMETRIES, LIBRARY_BUILD, PAGE, tq3_pool, tq3_variant_kernel, variant_build
from minima_kernels import choose_num_splits, pool_views
from sglang_minima.codec import LayerRotation


def main() -> None:
    dev, batch, ctx = "cuda", 8, 32768
    names = sys.argv[1:] or [LIBRARY_BUILD]
    for geom, (hq, h, d) in GEOMETRIES.items():
        n_tq3 = int(0.75 * ctx // PAGE)
        pool = tq3_pool(batch * n_tq3, h, d, LayerRotation(h, d, layer_id=0, seed=0, device=dev), dev)
        ids = torch.randperm(batch * n_tq3, device=dev).to(torch.int32)
        indptr = torch.arange(0, batch * n_tq3 + 1, n_tq3, dtype=torch.int32, device=dev)
        q = torch.randn(batch, hq, d, device=dev).to(torch.float16).view(torch.int32)
        for name in names:
            splits = choose_num_splits(batch, h, n_tq3, PAGE, d, build=variant_build(d, name))
            out = torch.empty(batch, hq, splits, d, device=dev)
            lse = torch.empty(batch, hq, splits, device=dev)
            kernel = tq3_variant_kernel(hq, h, d, name)
            kernel(q, *pool_views(pool), indptr, ids, out, lse)
            torch.cuda.synchronize()
            print(f"{geom} {name}: launched, splits {splits}", flush=True)


if __name__ == "__main__":
    main()
