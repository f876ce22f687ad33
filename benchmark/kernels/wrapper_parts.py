"""The mixed decode's parts timed alone (what bench_decode.py reports per part), over the path that
``MinimaDecodeWrapper``'s last ``plan()`` bound (``wrapper.decode``, decode_paths.py): each runs on
that plan's buffers, as ``run`` launches them.
"""

import torch
from minima_kernels import tq3_merge_splits
from minima_kernels.decode_paths import FP8OnlyDecode, FusedDecode

_merged: dict[tuple, tuple] = {}  # the TQ3 part's merged state: a combine kernel and buffers per shape


def run_tq3(wrapper, q_rot: torch.Tensor, tq3_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The TQ3 part alone, rotated space: q_rot [B, Hq, D] fp16 -> (out' fp32 [B, Hq, D], lse [B, Hq]).
    Two-launch plans only (a fused plan decodes both formats in one launch)."""
    decode = wrapper.decode
    if isinstance(decode, (FusedDecode, FP8OnlyDecode)):
        raise ValueError(f"run_tq3 times the two-launch path's TQ3 kernel; the plan is {type(decode).__name__}")
    p = decode.tq3_plan
    decode.tq3_kernel(q_rot.contiguous().view(torch.int32), tq3_pages.view(torch.int32), p.page_indptr, p.page_ids,
                      p.out_partial, p.lse_partial)
    b, hq, splits, d = p.out_partial.shape
    if splits == 1:
        return p.out_partial.view(b, hq, d), p.lse_partial.view(b, hq)
    key = (b, hq, d, p.out_partial.device)
    if key not in _merged:
        _merged[key] = (tq3_merge_splits(hq, d), torch.empty(b, hq, d, device=key[3]), torch.empty(b, hq, device=key[3]))
    merge, out, lse = _merged[key]
    merge(p.out_partial, p.lse_partial, out, lse)
    return out, lse


def run_fp8(wrapper, q: torch.Tensor, fp8_kv_cache, *, k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 part alone over the planned FP8 pages: FlashInfer's state (out [B, Hq, D], lse [B, Hq]
    base 2), or with the TileLang kernel its split partials ([B, Hq, S8, D] fp32, [B, Hq, S8])."""
    decode = wrapper.decode
    if isinstance(decode, FusedDecode) or decode.fp8 is None:
        raise ValueError(f"run_fp8 times a separate FP8 part; the plan is {type(decode).__name__} without one")
    return decode.fp8.run(q, fp8_kv_cache, k_scale, v_scale)


def run_glue(wrapper, q: torch.Tensor, signs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two launches around the attention kernels alone (q rotation in; split combine, un-rotation
    and merge out): what they cost."""
    decode = wrapper.decode
    if isinstance(decode, FP8OnlyDecode):
        raise ValueError("run_glue times the TQ3 paths' rotation and epilogue; the plan has no TQ3 pages")
    decode.tq3.rotate(q, signs)
    return decode.finish(signs)
