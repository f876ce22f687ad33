"""minima_kernels: GPU kernels of sglang-minima (TileLang + FlashInfer), importable without SGLang.

- ``MinimaDecodeWrapper``: mixed FP8 / TQ3 paged decode (plan once per batch shape, run per layer).
- ``mixed_decode_kernel``: both formats' split partials in one TileLang grid (the default mixed decode).
- ``tq3_decode_kernel`` / ``tq3_merge_splits``: the TileLang TQ3 split-KV decode and split combine.
- ``fp8_decode_kernel``: the TileLang FP8 split-KV decode (an FP8 part of the two-launch path).
- ``rotate_queries_kernel`` / ``mixed_epilogue_kernel``: q' = R q in (the codec's Hadamard rotation);
  split combine + un-rotation + merge of the TQ3 and FP8 states out (the mixed decode's glue).
- ``fp8_to_tq3`` / ``tq3_to_fp8``: batched page conversions, bit-identical to the torch codec.
"""

from .convert import fp8_to_tq3, fp8_to_tq3_kernel, tq3_to_fp8, tq3_to_fp8_kernel
from .decode import MinimaDecodeWrapper, choose_num_splits
from .fp8_decode import fp8_decode_kernel
from .rotation_merge import mixed_epilogue_kernel, rotate_queries_kernel, tq3_merge_splits
from .tq3_decode import mixed_decode_kernel, tile_config, tq3_decode_kernel

__all__ = [
    "MinimaDecodeWrapper",
    "choose_num_splits",
    "fp8_decode_kernel",
    "fp8_to_tq3",
    "fp8_to_tq3_kernel",
    "mixed_decode_kernel",
    "mixed_epilogue_kernel",
    "rotate_queries_kernel",
    "tile_config",
    "tq3_decode_kernel",
    "tq3_merge_splits",
    "tq3_to_fp8",
    "tq3_to_fp8_kernel",
]
