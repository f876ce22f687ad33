"""minima_kernels: GPU kernels of sglang-minima (TileLang + FlashInfer), importable without SGLang.

- ``MinimaDecodeWrapper``: mixed FP8 / TQ3 paged decode (plan once per batch shape, run per layer).
- ``tq3_decode_kernel`` / ``tq3_merge_splits``: the TileLang TQ3 split-KV decode and split combine.
- ``rotate_queries_kernel`` / ``mixed_epilogue_kernel``: q' = R q in; split combine + un-rotation +
  merge with the FP8 state out (the mixed decode's glue, one launch each).
- ``fp8_to_tq3`` / ``tq3_to_fp8``: batched page conversions, bit-identical to the torch codec.
"""

from .convert import fp8_to_tq3, fp8_to_tq3_kernel, tq3_to_fp8, tq3_to_fp8_kernel
from .decode import MinimaDecodeWrapper, choose_num_splits
from .rotation_merge import mixed_epilogue_kernel, rotate_queries_kernel
from .tq3_decode import tile_config, tq3_decode_kernel, tq3_merge_splits

__all__ = [
    "MinimaDecodeWrapper",
    "choose_num_splits",
    "fp8_to_tq3",
    "fp8_to_tq3_kernel",
    "mixed_epilogue_kernel",
    "rotate_queries_kernel",
    "tile_config",
    "tq3_decode_kernel",
    "tq3_merge_splits",
    "tq3_to_fp8",
    "tq3_to_fp8_kernel",
]
