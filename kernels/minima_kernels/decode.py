"""Mixed FP8 / TQ3 paged decode: FlashInfer or TileLang over the FP8 pages, TileLang over the TQ3
pages, one LSE merge. ``plan()`` does the host-side work once per batch shape (page lists to the device, split
count, output buffers, kernel selection); ``run()`` only launches device work, so it can be captured
in a CUDA graph with the planned buffers. Each ``plan()`` makes new buffers and may pick other split
counts or another FP8 kernel: a graph captured after one ``plan()`` must be captured again after the
next.

Per request, the FP8 pages (Recent + Anchor) and the TQ3 pages (Stale) are two disjoint sets of the
request's KV; attention is order-free, so each set is attended on its own, giving (out, lse) in base 2.
The TQ3 part runs in the rotated space (the codec's randomized Hadamard rotation, given by its signs).
Four launches: q' = R q (``rotate_queries_kernel``), the TQ3 split decode, the FP8 part on a side
stream (concurrent with the two before), and one epilogue that combines the splits, un-rotates and
merges the two states. The FP8 part is FlashInfer's decode (``fp8_kernel="flashinfer"``, merged state)
or ``fp8_decode_kernel`` (``"tilelang"``: split partials that the epilogue combines with the TQ3 ones);
``"fused"``: three launches, the FP8 pages as a second role of the TQ3 split decode's grid
(``mixed_decode_kernel``): both formats' CTAs in one wave, on one register and shared-memory budget,
one combine of both formats' splits. ``"auto"`` (the default) takes "fused" where it applies (FP8
pages of the TQ3 page size) unless its grid would take several waves of short TQ3 splits
(``fused_fits``); otherwise, the TileLang FP8 kernel for batches with few FP8 tokens, where
FlashInfer's fixed cost per call (its plan's split kernel and merge launch) dominates, and
FlashInfer's above. On the H200 this choice was within 2% of the fastest path timed at 78 of 81
mixed shapes (docs/results/kernels.md).
"""

from dataclasses import dataclass
from functools import partial

import flashinfer
import torch
from sglang_minima.codec.codebook import tq3_codebook
from sglang_minima.codec.layout import CHUNK_TOKENS, TQ3PageLayout
from sglang_minima.codec.rotation import is_power_of_two

from .fp8_decode import HEADS_PER_TILE as FP8_HEADS_PER_TILE
from .fp8_decode import FP8_BUILD_OPTIONS, fp8_decode_kernel, fp8_tile_config
from .rotation_merge import FP8_STATES, MAX_SPLITS, mixed_epilogue_kernel, rotate_queries_kernel, tq3_merge_splits
from .tq3_decode import FP8_STEP_CHUNKS, TQ3_BUILD_OPTIONS, mixed_decode_kernel, tile_config, tq3_decode_kernel

NUM_SMS_H200 = 132
MIN_CHUNKS_PER_WARP = 2  # a split gives each of its warps at least this many 16-token chunks
FP8_KERNELS = ("auto", "flashinfer", "tilelang", "fused")
# "auto": the TileLang FP8 decode up to this many FP8 page slots (pages x page size, per kv head) in
# the batch, by head dim (H200, both kernels side by side: docs/results/kernels.md; between the last
# shape the TileLang kernel won and the first FlashInfer won); other head dims: the smallest
TILELANG_FP8_MAX_TOKENS = {64: 32768, 128: 8192, 256: 16384}
TILELANG_FP8_PAGE_SIZES = (16, 32, 64)  # built and tested (larger pages: more shared memory than an SM has at head dim 256)
FP8_CTAS_PER_SM = 1  # the TileLang FP8 decode's splits: about this many CTAs per SM in all (1 beat 2)
FP8_MIN_PAGES_PER_SPLIT = 2
# "fused": the time of one FP8 chunk (16 tokens of one kv head) over a TQ3 chunk's in the one grid,
# which shares the splits between the formats
FUSED_FP8_CHUNK_WEIGHT = 1.0
# "auto": where the fused grid takes several waves (batch 32 on the H200), its equal-work TQ3 splits
# must hold at least this many pages; shorter ones lost to the two-launch path (batch 32 x 4K at 90%
# Stale: 119.1 / 94.8 us against 67.4 / 73.9 us for head dims 256 / 128, docs/results/kernels.md)
FUSED_MULTI_WAVE_MIN_PAGES = 16


def key_centroids_fp16(head_dim: int) -> tuple[float, ...]:
    """The TQ3 key codebook rounded to fp16 (the kernel's GEMM operand precision)."""
    return tuple(float(c) for c in tq3_codebook(head_dim).centroids.to(torch.float16).float())


def tilelang_fp8_preferred(fp8_slots: int, head_dim: int) -> bool:
    """The two-launch path's "auto": the TileLang FP8 decode (rather than FlashInfer) for a batch of
    this many FP8 page slots (pages x page size, per kv head)."""
    return fp8_slots <= TILELANG_FP8_MAX_TOKENS.get(head_dim, min(TILELANG_FP8_MAX_TOKENS.values()))


def slots_per_pair(batch: int, num_kv_heads: int, build: dict[str, int], num_sms: int = NUM_SMS_H200) -> int:
    """Resident CTA slots of the build in one wave of the GPU, per (request, kv head) pair."""
    return build["min_blocks"] * num_sms // (batch * num_kv_heads)


def choose_num_splits(
    batch: int,
    num_kv_heads: int,
    max_pages: int,
    page_size: int,
    head_dim: int,
    num_sms: int = NUM_SMS_H200,
    build: dict[str, int] | None = None,
) -> int:
    """Splits per (request, kv head) so that batch * kv_heads * splits CTAs fit the GPU's resident CTA
    slots in one wave (a second, partial wave would leave most SMs idle while it runs), with at least
    MIN_CHUNKS_PER_WARP chunks per warp in each split. ``build``: the kernel's warps and resident CTAs
    per SM (default: tile_config's for this batch size)."""
    build = build or tile_config(0, page_size, head_dim, batch)
    want = slots_per_pair(batch, num_kv_heads, build, num_sms)
    min_pages = max(1, -(-MIN_CHUNKS_PER_WARP * build["warps"] * CHUNK_TOKENS // page_size))
    return max(1, min(want, max_pages // min_pages))


def choose_fp8_splits(batch: int, num_kv_heads: int, max_pages: int, num_sms: int = NUM_SMS_H200) -> int:
    """Splits per (request, kv head) of the TileLang FP8 decode: about FP8_CTAS_PER_SM CTAs per SM,
    with at least FP8_MIN_PAGES_PER_SPLIT pages per split."""
    want = FP8_CTAS_PER_SM * num_sms // (batch * num_kv_heads)
    return max(1, min(want, max_pages // FP8_MIN_PAGES_PER_SPLIT, MAX_SPLITS))


def choose_mixed_splits(
    batch: int,
    num_kv_heads: int,
    max_tq3_pages: int,
    max_fp8_pages: int,
    page_size: int,
    build: dict[str, int],
    fp8_weight: float = FUSED_FP8_CHUNK_WEIGHT,
    num_sms: int = NUM_SMS_H200,
) -> tuple[int, int]:
    """(TQ3 splits, FP8 splits) per (request, kv head) of ``mixed_decode_kernel``: together the CTAs
    of one wave of the build's resident slots, shared in proportion to each format's work (an FP8
    chunk weighs ``fp8_weight`` TQ3 chunks). Where the (request, kv head) pairs leave fewer than two
    slots each, the grid takes several waves anyway: then splits of about equal work (one FP8 split,
    the TQ3 pages in as many), so that no long TQ3 CTA starts in a late wave. Each split has at
    least MIN_CHUNKS_PER_WARP chunks per warp."""
    slots = slots_per_pair(batch, num_kv_heads, build, num_sms)
    tq3_work, fp8_work = max_tq3_pages, fp8_weight * max_fp8_pages
    if slots >= 2:
        tq3 = min(slots - 1, max(1, round(slots * tq3_work / (tq3_work + fp8_work))))
        fp8 = slots - tq3
    else:
        tq3, fp8 = max(1, round(tq3_work / fp8_work)), 1
    min_pages = max(1, -(-MIN_CHUNKS_PER_WARP * build["warps"] * CHUNK_TOKENS // page_size))
    return max(1, min(tq3, max_tq3_pages // min_pages)), max(1, min(fp8, max_fp8_pages // min_pages))


def fused_fits(
    batch: int,
    num_kv_heads: int,
    max_tq3_pages: int,
    max_fp8_pages: int,
    page_size: int,
    build: dict[str, int],
    num_sms: int = NUM_SMS_H200,
) -> bool:
    """Whether "auto" takes the fused decode for this batch: unless its grid takes several waves
    (fewer than 2 resident slots per (request, kv head)) of TQ3 splits under FUSED_MULTI_WAVE_MIN_PAGES."""
    if slots_per_pair(batch, num_kv_heads, build, num_sms) >= 2:
        return True
    tq3_splits, _ = choose_mixed_splits(batch, num_kv_heads, max_tq3_pages, max_fp8_pages, page_size, build, num_sms=num_sms)
    return max_tq3_pages >= FUSED_MULTI_WAVE_MIN_PAGES * tq3_splits


def fused_build_of(tq3_build: dict[str, int], page_size: int) -> dict[str, int]:
    """``mixed_decode_kernel``'s build: the TQ3 decode's, its FP8 role taking steps of FP8_STEP_CHUNKS
    chunks (at most a page)."""
    return {**tq3_build, "fp8_step_chunks": min(FP8_STEP_CHUNKS, page_size // CHUNK_TOKENS)}


def _build_overrides(name: str, config: dict[str, int] | None, options: tuple[str, ...]) -> dict[str, int]:
    """A kernel's build options given by the caller (``name``), checked against the ones it takes."""
    config = config or {}
    if unknown := set(config) - set(options):
        raise ValueError(f"{name}: unknown options {sorted(unknown)}, the kernel takes {options}")
    return config


def _built(kernels: dict[tuple, object], build: dict[str, int], make) -> object:
    """The kernel of ``build`` from the cache ``kernels``, made by ``make(**build)`` on first use."""
    key = tuple(sorted(build.items()))
    if key not in kernels:
        kernels[key] = make(**build)
    return kernels[key]


def _check_float_scales(k_scale, v_scale) -> None:
    if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        raise TypeError("the TileLang FP8 decodes take k_scale / v_scale as Python floats (fixed in a captured graph)")


@dataclass
class FP8SplitPlan:
    """Device-side state of the FP8 part of one plan whose FP8 pages give split partials (the TileLang
    FP8 decode's or the fused decode's)."""

    page_indptr: torch.Tensor
    page_ids: torch.Tensor
    last_page_len: torch.Tensor
    num_splits: int
    out_partial: torch.Tensor
    lse_partial: torch.Tensor


@dataclass
class TQ3Plan:
    """Device-side state of the TQ3 part of one plan (page lists, split buffers)."""

    page_indptr: torch.Tensor
    page_ids: torch.Tensor
    num_splits: int
    out_partial: torch.Tensor
    lse_partial: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    q_rot: torch.Tensor  # [batch, Hq, D] fp16


class MinimaDecodeWrapper:
    """Decode attention over a mixed FP8 / TQ3 paged KV cache (one layer per ``run``).

    FP8 pages: ``(k_cache, v_cache)`` each ``[num_fp8_pages, page_size, H, D]`` e4m3 (SGLang's
    ``[slots, H, D]`` buffers viewed per page), per-layer scales. TQ3 pages: ``[num_tq3_pages,
    page_bytes]`` uint8 TQ3P blocks. Rotation: its signs ``[H, D]`` fp32 (``LayerRotation.signs``; the
    head dim is a power of two, so the codec's rotation is the Hadamard one).

    ``fp8_kernel``: the FP8 part's kernel when the batch also has TQ3 pages (a batch without TQ3 pages
    is FlashInfer's decode alone): "fused", "flashinfer", "tilelang" or "auto" ("fused" for FP8 pages of
    the TQ3 page size where ``fused_fits``, else by the batch's FP8 page slots, at ``plan``; FlashInfer
    where the TileLang kernel does not apply: GQA groups over 16 query heads, FP8 pages other than 16 /
    32 / 64 tokens). With the TileLang kernels, ``run``'s k_scale / v_scale are Python floats, fixed in
    a captured graph. ``overlap_fp8``: the FP8 part on a side stream.
    ``tq3_config``: build options of the TQ3 decode over ``tile_config``'s for the batch (e.g. warps,
    min_blocks; also the fused kernel's); ``fp8_config``: of the TileLang FP8 decode over
    ``fp8_tile_config``'s (e.g. pages_per_step). ``fp8_kernel="fused"`` runs the FP8 pages in the TQ3
    decode's grid (``mixed_decode_kernel``; FP8 pages of the TQ3 page size, scales as Python floats).
    """

    def __init__(
        self,
        workspace: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        sm_scale: float | None = None,
        q_dtype: torch.dtype = torch.bfloat16,
        fp8_page_size: int | None = None,
        overlap_fp8: bool = True,
        fp8_kernel: str = "auto",
        tq3_config: dict[str, int] | None = None,
        fp8_config: dict[str, int] | None = None,
    ) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if not is_power_of_two(head_dim):
            raise ValueError(f"head_dim={head_dim}: the TQ3 kernels need a power of two (Hadamard rotation)")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group_size = num_qo_heads // num_kv_heads
        self.page_size = page_size
        self.fp8_page_size = page_size if fp8_page_size is None else fp8_page_size
        self.sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self.q_dtype = q_dtype
        self.layout = TQ3PageLayout(num_kv_heads, page_size, head_dim)
        self.device = workspace.device
        self._fp8 = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        # the TQ3 decode's builds (warps, resident CTAs per SM, ...): tile_config's for the batch, or
        # overridden; each built by the first plan() that takes it
        self._tq3_config = _build_overrides("tq3_config", tq3_config, TQ3_BUILD_OPTIONS)
        self._tq3_kernels: dict[tuple, object] = {}
        self._tq3_build: dict[str, int] | None = None
        self._tq3_kernel = None
        self._merge_kernel = tq3_merge_splits(num_qo_heads, head_dim)
        dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(q_dtype)
        if dtype is None:
            raise ValueError(f"q_dtype must be torch.bfloat16 or torch.float16, got {q_dtype}")
        self._rotate_kernel = rotate_queries_kernel(num_qo_heads, self.group_size, head_dim, dtype)
        self._epilogue = {
            state: mixed_epilogue_kernel(num_qo_heads, self.group_size, head_dim, state, dtype) for state in FP8_STATES
        }
        self._dtype_name = dtype
        self._tilelang_fp8_ok = self.group_size <= FP8_HEADS_PER_TILE and self.fp8_page_size in TILELANG_FP8_PAGE_SIZES
        # the TileLang FP8 decode's builds (fp8_tile_config's for the split length, or overridden),
        # each built by the first plan() that takes it
        self._fp8_config = _build_overrides("fp8_config", fp8_config, FP8_BUILD_OPTIONS)
        self._fp8_kernels: dict[tuple, object] = {}
        self._fp8_build: dict[str, int] | None = None
        self._fp8_kernel = None
        # "fused": the TQ3 decode's builds with an FP8 role (mixed_decode_kernel), each built by the
        # first plan() that takes it
        self._mixed_kernels: dict[tuple, object] = {}
        self._mixed_kernel = None
        self._side_stream = torch.cuda.Stream(self.device)
        self.overlap_fp8 = overlap_fp8  # the FP8 part on a side stream, concurrent with the TQ3 part
        self.fp8_kernel = fp8_kernel
        self._has_fp8 = self._has_tq3 = False
        self.tq3_plan: TQ3Plan | None = None
        self.fp8_plan: FP8SplitPlan | None = None

    def plan(
        self,
        fp8_indptr: torch.Tensor,
        fp8_page_ids: torch.Tensor,
        fp8_last_page_len: torch.Tensor,
        tq3_indptr: torch.Tensor,
        tq3_page_ids: torch.Tensor,
        *,
        num_splits: int | None = None,
        num_fp8_splits: int | None = None,
    ) -> None:
        """Page lists per request (CSR, int32, host tensors): FP8 pages with the fill of each
        request's last FP8 page, and TQ3 pages (always full). A request may have no pages of one
        format; every request must have at least one page in total. ``num_splits`` / ``num_fp8_splits``:
        splits per (request, kv head) of the TQ3 part / the TileLang FP8 part (default:
        ``choose_num_splits`` / ``choose_fp8_splits``)."""
        batch = fp8_indptr.numel() - 1
        if tq3_indptr.numel() - 1 != batch:
            raise ValueError(f"fp8_indptr has {batch} requests, tq3_indptr {tq3_indptr.numel() - 1}")
        fp8_counts = fp8_indptr[1:] - fp8_indptr[:-1]
        tq3_counts = tq3_indptr[1:] - tq3_indptr[:-1]
        if bool(((fp8_counts + tq3_counts) == 0).any()):
            raise ValueError("every request needs at least one FP8 or TQ3 page")
        if self.fp8_kernel == "fused" and self.fp8_page_size != self.page_size:
            raise ValueError(f"fp8_kernel='fused' takes FP8 pages of the TQ3 page size {self.page_size}, got {self.fp8_page_size}")
        if self.fp8_kernel == "tilelang" and not self._tilelang_fp8_ok:
            raise ValueError(
                f"fp8_kernel='tilelang' takes GQA groups of at most {FP8_HEADS_PER_TILE} query heads and FP8 pages of "
                f"{TILELANG_FP8_PAGE_SIZES} tokens, got group {self.group_size}, page {self.fp8_page_size}"
            )
        has_fp8, has_tq3 = int(fp8_indptr[-1]) > 0, int(tq3_indptr[-1]) > 0
        fp8_slots = int(fp8_indptr[-1]) * self.fp8_page_size
        max_fp8_pages = max(fp8_counts.tolist(), default=0)
        max_tq3_pages = max(tq3_counts.tolist(), default=0)
        tq3_build = {**tile_config(self.group_size, self.page_size, self.head_dim, batch), **self._tq3_config} if has_tq3 else None
        # "auto": the fused decode where it applies (FP8 pages of the TQ3 page size) unless its grid
        # would take several waves of short TQ3 splits; else the TileLang FP8 decode or FlashInfer by
        # the batch's FP8 slots
        use_fused = has_fp8 and has_tq3 and (
            self.fp8_kernel == "fused"
            or (
                self.fp8_kernel == "auto"
                and self.fp8_page_size == self.page_size
                and fused_fits(batch, self.num_kv_heads, max_tq3_pages, max_fp8_pages, self.page_size, tq3_build)
            )
        )
        use_tilelang = (
            has_fp8
            and has_tq3
            and not use_fused
            and self._tilelang_fp8_ok
            and (
                self.fp8_kernel == "tilelang"
                or (self.fp8_kernel == "auto" and tilelang_fp8_preferred(fp8_slots, self.head_dim))
            )
        )
        if use_fused:
            tq3_splits, fp8_splits = choose_mixed_splits(batch, self.num_kv_heads, max_tq3_pages, max_fp8_pages, self.page_size, tq3_build)
            tq3_splits, fp8_splits = num_splits or tq3_splits, num_fp8_splits or fp8_splits
        else:
            fp8_splits = (num_fp8_splits or choose_fp8_splits(batch, self.num_kv_heads, max_fp8_pages)) if use_tilelang else 0
            tq3_splits = (
                num_splits
                or choose_num_splits(batch, self.num_kv_heads, max_tq3_pages, self.page_size, self.head_dim, build=tq3_build)
                if has_tq3
                else 0
            )
        fp8_parts = use_tilelang or use_fused  # the FP8 part as split partials
        for name, splits, used in (("num_fp8_splits", fp8_splits, fp8_parts), ("num_splits", tq3_splits, has_tq3)):
            if used and not 1 <= splits <= MAX_SPLITS:
                raise ValueError(f"{name}={splits}: the split combine takes 1 to {MAX_SPLITS}")
        fp8_build = (
            {**fp8_tile_config(self.fp8_page_size, self.head_dim, -(-max_fp8_pages // fp8_splits)), **self._fp8_config}
            if use_tilelang
            else None
        )
        # the kernels of the two builds, each compiled on first use (a failed build leaves the plan as it was)
        shape = (self.num_kv_heads, self.group_size, self.head_dim)
        fp8_kernel = tq3_kernel = mixed_kernel = None
        if use_fused:
            fused_build = fused_build_of(tq3_build, self.page_size)
            make = partial(mixed_decode_kernel, *shape, self.page_size, self.sm_scale, key_centroids_fp16(self.head_dim), self._dtype_name)
            mixed_kernel = _built(self._mixed_kernels, fused_build, make)
        if use_tilelang:
            make = partial(fp8_decode_kernel, *shape, self.fp8_page_size, self.sm_scale, self._dtype_name)
            fp8_kernel = _built(self._fp8_kernels, fp8_build, make)
        if has_tq3 and not use_fused:  # (a fused plan's TQ3 pages are its mixed kernel's)
            make = partial(tq3_decode_kernel, *shape, self.page_size, self.sm_scale, key_centroids_fp16(self.head_dim))
            tq3_kernel = _built(self._tq3_kernels, tq3_build, make)
        # validated: from here on the wrapper's state changes
        self._tq3_build, self._tq3_kernel = tq3_build, tq3_kernel
        self._fp8_build, self._fp8_kernel = fp8_build, fp8_kernel
        self._mixed_kernel = mixed_kernel
        self._batch = batch
        self._has_fp8, self._has_tq3 = has_fp8, has_tq3
        dev = self.device
        self.fp8_plan = None
        if fp8_parts:
            hq, d, splits = self.num_qo_heads, self.head_dim, fp8_splits
            # a TileLang FP8 step of several pages reads up to pages_per_step - 1 ids past a split's last page
            padding = fp8_build["pages_per_step"] - 1 if use_tilelang else 0
            self.fp8_plan = FP8SplitPlan(
                page_indptr=fp8_indptr.to(dev, torch.int32),
                page_ids=torch.cat([fp8_page_ids.to(torch.int32), fp8_page_ids.new_zeros(padding, dtype=torch.int32)]).to(dev),
                last_page_len=fp8_last_page_len.to(dev, torch.int32),
                num_splits=splits,
                out_partial=torch.empty(batch, hq, splits, d, device=dev, dtype=torch.float32),
                lse_partial=torch.empty(batch, hq, splits, device=dev, dtype=torch.float32),
            )
        elif self._has_fp8:
            self._fp8.plan(
                fp8_indptr.to(dev, torch.int32),
                fp8_page_ids.to(dev, torch.int32),
                fp8_last_page_len.to(dev, torch.int32),
                self.num_qo_heads,
                self.num_kv_heads,
                self.head_dim,
                self.fp8_page_size,
                q_data_type=self.q_dtype,
                kv_data_type=torch.float8_e4m3fn,
                sm_scale=self.sm_scale,
            )
        self.tq3_plan = None
        hq, d = self.num_qo_heads, self.head_dim
        if self._has_tq3:
            splits = tq3_splits
            f32 = {"device": dev, "dtype": torch.float32}
            self.tq3_plan = TQ3Plan(
                page_indptr=tq3_indptr.to(dev, torch.int32),
                page_ids=tq3_page_ids.to(dev, torch.int32),
                num_splits=splits,
                out_partial=torch.empty(batch, hq, splits, d, **f32),
                lse_partial=torch.empty(batch, hq, splits, **f32),
                out=torch.empty(batch, hq, d, **f32),
                lse=torch.empty(batch, hq, **f32),
                q_rot=torch.empty(batch, hq, d, device=dev, dtype=torch.float16),
            )
        self._out = torch.empty(batch, hq, d, device=dev, dtype=self.q_dtype)
        self._lse = torch.empty(batch, hq, device=dev, dtype=torch.float32)
        self._fp8_out = torch.empty(batch, hq, d, device=dev, dtype=self.q_dtype)
        self._fp8_lse = torch.empty(batch, hq, device=dev, dtype=torch.float32)

    @property
    def fp8_kernel(self) -> str:
        return self._fp8_kernel_choice

    @fp8_kernel.setter
    def fp8_kernel(self, choice: str) -> None:  # takes effect at the next plan()
        if choice not in FP8_KERNELS:
            raise ValueError(f"fp8_kernel={choice!r}: one of {FP8_KERNELS}")
        self._fp8_kernel_choice = choice

    def run_tq3(self, q_rot: torch.Tensor, tq3_pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TQ3 part alone, rotated space: q_rot [B, Hq, D] fp16 -> (out' fp32 [B, Hq, D], lse [B, Hq]).
        Two-launch plans only (a fused plan decodes both formats in one launch)."""
        if self._mixed_kernel is not None:
            raise ValueError("a fused plan (fp8_kernel='fused') decodes the TQ3 pages with the FP8 pages: run() only")
        p = self.tq3_plan
        self._split_decode(q_rot.contiguous(), tq3_pages)
        if p.num_splits == 1:
            return p.out_partial.view(p.out.shape), p.lse_partial.view(p.lse.shape)
        self._merge_kernel(p.out_partial, p.lse_partial, p.out, p.lse)
        return p.out, p.lse

    def run_fp8(self, q: torch.Tensor, fp8_kv_cache, *, k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 part alone over the planned FP8 pages: FlashInfer's state (out [B, Hq, D], lse [B, Hq]
        base 2), or with the TileLang kernel its split partials ([B, Hq, S8, D] fp32, [B, Hq, S8])."""
        p = self.fp8_plan
        if p is None:
            self._fp8.run(q, fp8_kv_cache, k_scale=k_scale, v_scale=v_scale, out=self._fp8_out, lse=self._fp8_lse, return_lse=True)
            return self._fp8_out, self._fp8_lse
        if self._mixed_kernel is not None:
            raise ValueError("a fused plan (fp8_kernel='fused') decodes the FP8 pages with the TQ3 pages: run() only")
        _check_float_scales(k_scale, v_scale)
        k_cache, v_cache = fp8_kv_cache
        self._fp8_kernel(
            q,
            k_cache,
            v_cache,
            p.page_indptr,
            p.page_ids,
            p.last_page_len,
            1.0 if k_scale is None else float(k_scale),
            1.0 if v_scale is None else float(v_scale),
            p.out_partial,
            p.lse_partial,
        )
        return p.out_partial, p.lse_partial

    def run_glue(self, q: torch.Tensor, signs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The two launches around the attention kernels alone (q rotation in; split combine, un-rotation
        and merge out) on the planned buffers, as ``run`` launches them: what they cost."""
        self._rotate_queries(q, signs)
        return self._finish(signs)

    def _rotate_queries(self, q: torch.Tensor, signs: torch.Tensor) -> None:
        self._rotate_kernel(q, signs, self.tq3_plan.q_rot)

    def _fused_decode(self, q: torch.Tensor, fp8_kv_cache, tq3_pages: torch.Tensor, k_scale, v_scale) -> None:
        """Both formats' split partials in one launch (``mixed_decode_kernel``)."""
        _check_float_scales(k_scale, v_scale)
        p, f = self.tq3_plan, self.fp8_plan
        k_cache, v_cache = fp8_kv_cache
        self._mixed_kernel(
            p.q_rot.view(torch.int32),
            q.view(torch.int32),
            tq3_pages.view(torch.int32),
            k_cache.view(torch.uint8),
            v_cache.view(torch.uint8),
            p.page_indptr,
            p.page_ids,
            f.page_indptr,
            f.page_ids,
            f.last_page_len,
            1.0 if k_scale is None else float(k_scale),
            1.0 if v_scale is None else float(v_scale),
            p.out_partial,
            p.lse_partial,
            f.out_partial,
            f.lse_partial,
        )

    def _split_decode(self, q_rot: torch.Tensor, tq3_pages: torch.Tensor) -> None:
        p = self.tq3_plan
        self._tq3_kernel(q_rot.view(torch.int32), tq3_pages.view(torch.int32), p.page_indptr, p.page_ids, p.out_partial, p.lse_partial)

    def _finish(self, signs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The epilogue: split combine, un-rotation and merge with the FP8 state into the outputs."""
        p, f = self.tq3_plan, self.fp8_plan
        state = "splits" if f is not None else "merged" if self._has_fp8 else "none"
        fp8_out, fp8_lse = (f.out_partial, f.lse_partial) if f is not None else (self._fp8_out, self._fp8_lse)
        self._epilogue[state](p.out_partial, p.lse_partial, signs, fp8_out, fp8_lse, self._out, self._lse)
        return self._out, self._lse

    def run(
        self,
        q: torch.Tensor,
        fp8_kv_cache: tuple[torch.Tensor, torch.Tensor] | None,
        tq3_pages: torch.Tensor | None,
        signs: torch.Tensor,
        *,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, Hq, D] (q_dtype) -> (out [B, Hq, D] q_dtype, lse [B, Hq] fp32, base 2). The outputs
        are the plan's buffers, overwritten by the next run."""
        if q.dtype != self.q_dtype:
            raise ValueError(f"q has dtype {q.dtype}, the wrapper was built for {self.q_dtype}")
        if not self._has_tq3:
            return self.run_fp8(q, fp8_kv_cache, k_scale=k_scale, v_scale=v_scale)
        if self._mixed_kernel is not None:
            self._rotate_queries(q, signs)
            self._fused_decode(q.contiguous(), fp8_kv_cache, tq3_pages, k_scale, v_scale)
            return self._finish(signs)
        main = torch.cuda.current_stream(self.device)
        overlap = self._has_fp8 and self.overlap_fp8
        if overlap:  # independent of the TQ3 part
            self._side_stream.wait_stream(main)
            with torch.cuda.stream(self._side_stream):
                self.run_fp8(q, fp8_kv_cache, k_scale=k_scale, v_scale=v_scale)
        self._rotate_queries(q, signs)
        self._split_decode(self.tq3_plan.q_rot, tq3_pages)
        if overlap:
            main.wait_stream(self._side_stream)
        elif self._has_fp8:
            self.run_fp8(q, fp8_kv_cache, k_scale=k_scale, v_scale=v_scale)
        return self._finish(signs)
