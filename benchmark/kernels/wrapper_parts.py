"""The mixed decode's parts timed alone (what bench_decode.py reports per part): not part of
``MinimaDecodeWrapper``'s API, so they reach into its planned state here, beside the benchmark.

Each runs on the buffers of the wrapper's last ``plan()``, as ``run`` launches them.
"""

import torch


def run_tq3(wrapper, q_rot: torch.Tensor, tq3_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The TQ3 part alone, rotated space: q_rot [B, Hq, D] fp16 -> (out' fp32 [B, Hq, D], lse [B, Hq]).
    Two-launch plans only (a fused plan decodes both formats in one launch)."""
    if wrapper._mixed_kernel is not None:
        raise ValueError("a fused plan (fp8_kernel='fused') decodes the TQ3 pages with the FP8 pages: run() only")
    p = wrapper.tq3_plan
    wrapper._split_decode(q_rot.contiguous(), tq3_pages)
    if p.num_splits == 1:
        return p.out_partial.view(p.out.shape), p.lse_partial.view(p.lse.shape)
    wrapper._merge_kernel(p.out_partial, p.lse_partial, p.out, p.lse)
    return p.out, p.lse


def run_fp8(wrapper, q: torch.Tensor, fp8_kv_cache, *, k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The FP8 part alone over the planned FP8 pages: FlashInfer's state (out [B, Hq, D], lse [B, Hq]
    base 2), or with the TileLang kernel its split partials ([B, Hq, S8, D] fp32, [B, Hq, S8])."""
    return wrapper._run_fp8(q, fp8_kv_cache, k_scale=k_scale, v_scale=v_scale)


def run_glue(wrapper, q: torch.Tensor, signs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two launches around the attention kernels alone (q rotation in; split combine, un-rotation
    and merge out): what they cost."""
    wrapper._rotate_queries(q, signs)
    return wrapper._finish(signs)
