"""One eager launch of each TQ3 decode build variant named on the command line (default: the
library build), per geometry, at batch 8 x 32K, 75% Stale: the workload Nsight Compute profiles.

    ncu -k regex:tq3_decode --section WarpStateStats ... python3 scripts/device/profile_tq3.py [variant ...]
"""

import sys

import torch

sys.path.insert(0, "benchmark/kernels")
from bench_decode import GEOMETRIES, LIBRARY_BUILD, variant_case, variant_launch


def main() -> None:
    names = sys.argv[1:] or [LIBRARY_BUILD]
    for geom, (hq, h, d) in GEOMETRIES.items():
        inputs, n_tq3 = variant_case(hq, h, d, "cuda")
        for name in names:
            launch, splits = variant_launch(hq, h, d, name, inputs, n_tq3, "cuda")
            launch()
            torch.cuda.synchronize()
            print(f"{geom} {name}: launched, splits {splits}", flush=True)


if __name__ == "__main__":
    main()
