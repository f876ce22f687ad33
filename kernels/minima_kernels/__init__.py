"""minima_kernels: GPU kernels of sglang-minima (TileLang + FlashInfer), importable without SGLang.

One module per kernel, named for it:

- ``MinimaDecodeWrapper`` (decode.py): mixed FP8 / TQ3 paged decode (plan once per batch shape, run per
  layer); its paths, one small class each (FP8 only, two-launch, fused), in decode_paths.py.
- ``MinimaPrefillWrapper`` (prefill.py): extend / chunked prefill over a mixed prefix (FlashInfer over
  the new tokens and the FP8 hot prefix, the TQ3 prefix in bounded tiles, one LSE merge).
- ``mixed_decode_kernel`` (mixed_decode.py): both formats' split partials in one TileLang grid (the default).
- ``tq3_decode_kernel`` (tq3_decode.py): the TQ3 split-KV decode of the two-launch path; both decodes
  share split_decode.py (the split body) and device_source.py (its inline CUDA).
- ``fp8_decode_kernel`` (fp8_decode.py): the TileLang FP8 split-KV decode (an FP8 part of the two-launch path).
- ``rotate_queries_kernel`` / ``tq3_merge_splits`` / ``mixed_epilogue_kernel`` (rotation_merge.py):
  q' = R q in (the codec's Hadamard rotation); split combine, un-rotation and merge of the states out.
- ``fp8_to_tq3`` / ``tq3_to_fp8`` (convert.py): batched page conversions, bit-identical to the torch codec;
  ``PageConversions``: both kernels of one geometry built once (what the memory system calls per layer).
- heuristics.py: every build, split and path rule (pure Python, CPU-tested); common.py: constants and
  limits the kernels share.

Names are imported on first use, so ``minima_kernels.heuristics`` and ``minima_kernels.common`` load
without tilelang or flashinfer.
"""

import importlib

_EXPORTS = {
    "MinimaDecodeWrapper": "decode",
    "MinimaPrefillWrapper": "prefill",
    "choose_num_splits": "heuristics",
    "tile_config": "heuristics",
    "fp8_decode_kernel": "fp8_decode",
    "PageConversions": "convert",
    "conversion_scales": "convert",
    "fp8_to_tq3": "convert",
    "fp8_to_tq3_kernel": "convert",
    "tq3_to_fp8": "convert",
    "tq3_to_fp8_kernel": "convert",
    "mixed_decode_kernel": "mixed_decode",
    "tq3_decode_kernel": "tq3_decode",
    "mixed_epilogue_kernel": "rotation_merge",
    "rotate_queries_kernel": "rotation_merge",
    "tq3_merge_splits": "rotation_merge",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'minima_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
