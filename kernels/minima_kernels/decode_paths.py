"""The decode paths of ``MinimaDecodeWrapper``, one small class each, bound by ``plan()`` /
``plan_graph()`` to one batch's page lists, kernels and buffers; ``run()`` launches device work only.

- ``FP8OnlyDecode``: a batch without TQ3 pages, FlashInfer's decode alone.
- ``TwoLaunchDecode``: the TQ3 split decode in the rotated space, the FP8 pages beside it (FlashInfer's
  merged state or the TileLang FP8 decode's split partials, on a side stream when ``overlap``), one
  epilogue that combines the splits, un-rotates and merges.
- ``FusedDecode``: both formats' split partials in one grid (``mixed_decode_kernel``), then the
  epilogue; three launches in all (the default where it applies).

Each path holds what it reads: its page lists (``TQ3Plan``, ``FP8SplitPlan``), kernels and output
buffers. Which path a batch takes, and its split counts, is ``heuristics.choose_path``'s.
"""

from dataclasses import dataclass

import torch


def _check_float_scales(k_scale, v_scale) -> None:
    if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        raise TypeError("the TileLang FP8 decodes take k_scale / v_scale as Python floats (fixed in a captured graph)")


def _scale(s: float | None) -> float:
    return 1.0 if s is None else float(s)


@dataclass
class FP8SplitPlan:
    """The FP8 pages of a plan whose FP8 part gives split partials (the TileLang FP8 decode's or the
    fused decode's): page lists on the device and the partials' buffers."""

    page_indptr: torch.Tensor
    page_ids: torch.Tensor
    last_page_len: torch.Tensor
    num_splits: int
    out_partial: torch.Tensor  # [B, Hq, splits, D] fp32
    lse_partial: torch.Tensor  # [B, Hq, splits] base 2


@dataclass
class TQ3Plan:
    """The TQ3 pages of a plan: page lists on the device, the split buffers and the rotated queries."""

    page_indptr: torch.Tensor
    page_ids: torch.Tensor
    num_splits: int
    out_partial: torch.Tensor  # [B, Hq, splits, D] fp32
    lse_partial: torch.Tensor  # [B, Hq, splits]
    q_rot: torch.Tensor  # [B, Hq, D] fp16


@dataclass
class Outputs:
    """A plan's output buffers: the merged state (out in the query dtype, lse base 2), overwritten
    by every run."""

    out: torch.Tensor  # [B, Hq, D]
    lse: torch.Tensor  # [B, Hq] fp32


class FlashInferFP8:
    """The FP8 pages through FlashInfer's decode (planned by the wrapper): a merged state."""

    state = "merged"  # the epilogue's name for what this part gives

    def __init__(self, decode, out: Outputs) -> None:
        self.decode, self.out = decode, out

    @property
    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``run`` writes: out [B, Hq, D] (query dtype), lse [B, Hq] base 2."""
        return self.out.out, self.out.lse

    def run(self, q, fp8_kv_cache, k_scale, v_scale) -> tuple[torch.Tensor, torch.Tensor]:
        o = self.out
        self.decode.run(q, fp8_kv_cache, k_scale=k_scale, v_scale=v_scale, out=o.out, lse=o.lse, return_lse=True)
        return self.result


class TileLangFP8:
    """The FP8 pages through the TileLang FP8 split decode: split partials for the epilogue."""

    state = "splits"

    def __init__(self, kernel, plan: FP8SplitPlan) -> None:
        self.kernel, self.plan = kernel, plan

    @property
    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``run`` writes: the split partials, [B, Hq, splits, D] fp32 and [B, Hq, splits]."""
        return self.plan.out_partial, self.plan.lse_partial

    def run(self, q, fp8_kv_cache, k_scale, v_scale) -> tuple[torch.Tensor, torch.Tensor]:
        _check_float_scales(k_scale, v_scale)
        p = self.plan
        k_cache, v_cache = fp8_kv_cache
        self.kernel(
            q, k_cache, v_cache, p.page_indptr, p.page_ids, p.last_page_len,
            _scale(k_scale), _scale(v_scale), p.out_partial, p.lse_partial,
        )
        return self.result


class RotatedTQ3:
    """What both TQ3 paths share: the plan, the query rotation before and the epilogue after."""

    def __init__(self, plan: TQ3Plan, rotate, epilogue: dict, out: Outputs) -> None:
        self.plan, self._rotate, self._epilogue, self.out = plan, rotate, epilogue, out

    def rotate(self, q: torch.Tensor, signs: torch.Tensor) -> None:
        self._rotate(q, signs, self.plan.q_rot)

    def finish(self, signs: torch.Tensor, state: str, fp8_out: torch.Tensor, fp8_lse: torch.Tensor):
        """Split combine, un-rotation and merge with the FP8 state (``state``: "merged", "splits" or
        "none", whose tensors the kernel does not read) into the outputs."""
        p, o = self.plan, self.out
        self._epilogue[state](p.out_partial, p.lse_partial, signs, fp8_out, fp8_lse, o.out, o.lse)
        return o.out, o.lse


class FP8OnlyDecode:
    """A batch without TQ3 pages: FlashInfer's decode over the FP8 pages is the whole answer."""

    tq3_plan = fp8_plan = None

    def __init__(self, fp8: FlashInferFP8) -> None:
        self.fp8 = fp8
        self.out = fp8.out

    def run(self, q, fp8_kv_cache, tq3_pages, signs, k_scale, v_scale):
        return self.fp8.run(q, fp8_kv_cache, k_scale, v_scale)


class TwoLaunchDecode:
    """The TQ3 split decode, and the FP8 part (FlashInfer or TileLang, or none) beside it: on a side
    stream, concurrent with the rotation and the TQ3 decode, when ``overlap``."""

    def __init__(self, tq3: RotatedTQ3, tq3_kernel, fp8, placeholder: Outputs, side_stream, overlap: bool) -> None:
        self.tq3, self.tq3_kernel, self.fp8 = tq3, tq3_kernel, fp8
        self._placeholder = placeholder  # the epilogue's FP8 arguments where there is no FP8 part
        self._side_stream, self.overlap = side_stream, overlap and fp8 is not None
        self.out = tq3.out

    @property
    def tq3_plan(self) -> TQ3Plan:
        return self.tq3.plan

    @property
    def fp8_plan(self) -> FP8SplitPlan | None:
        return self.fp8.plan if isinstance(self.fp8, TileLangFP8) else None

    def run(self, q, fp8_kv_cache, tq3_pages, signs, k_scale, v_scale):
        main = torch.cuda.current_stream(q.device)
        if self.overlap:  # independent of the TQ3 part
            self._side_stream.wait_stream(main)
            with torch.cuda.stream(self._side_stream):
                self.fp8.run(q, fp8_kv_cache, k_scale, v_scale)
        self.tq3.rotate(q, signs)
        p = self.tq3.plan
        self.tq3_kernel(p.q_rot.view(torch.int32), tq3_pages.view(torch.int32), p.page_indptr, p.page_ids, p.out_partial, p.lse_partial)
        if self.overlap:
            main.wait_stream(self._side_stream)
        elif self.fp8 is not None:
            self.fp8.run(q, fp8_kv_cache, k_scale, v_scale)
        return self.finish(signs)

    def finish(self, signs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The epilogue over the TQ3 splits and the FP8 part's result."""
        if self.fp8 is None:
            return self.tq3.finish(signs, "none", self._placeholder.out, self._placeholder.lse)
        return self.tq3.finish(signs, self.fp8.state, *self.fp8.result)


class FusedDecode:
    """Both formats' split partials in one launch (``mixed_decode_kernel``: TQ3 and FP8 CTAs of one
    grid), then the epilogue over both."""

    def __init__(self, kernel, tq3: RotatedTQ3, fp8_plan: FP8SplitPlan) -> None:
        self.kernel, self.tq3, self.fp8_plan = kernel, tq3, fp8_plan
        self.out = tq3.out

    @property
    def tq3_plan(self) -> TQ3Plan:
        return self.tq3.plan

    def run(self, q, fp8_kv_cache, tq3_pages, signs, k_scale, v_scale):
        _check_float_scales(k_scale, v_scale)
        self.tq3.rotate(q, signs)
        p, f = self.tq3.plan, self.fp8_plan
        k_cache, v_cache = fp8_kv_cache
        self.kernel(
            p.q_rot.view(torch.int32),
            q.contiguous().view(torch.int32),
            tq3_pages.view(torch.int32),
            k_cache.view(torch.uint8),
            v_cache.view(torch.uint8),
            p.page_indptr,
            p.page_ids,
            f.page_indptr,
            f.page_ids,
            f.last_page_len,
            _scale(k_scale),
            _scale(v_scale),
            p.out_partial,
            p.lse_partial,
            f.out_partial,
            f.lse_partial,
        )
        return self.finish(signs)

    def finish(self, signs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The epilogue over both formats' splits."""
        return self.tq3.finish(signs, "splits", self.fp8_plan.out_partial, self.fp8_plan.lse_partial)
