"""Mixed FP8 / TQ3 paged decode: FlashInfer or TileLang over the FP8 pages, TileLang over the TQ3
pages, one LSE merge. ``plan()`` does the host-side work once per batch shape (page lists to the device, split
count, output buffers, kernel selection); ``run()`` only launches device work. ``plan()`` reads the
page lists on the host and picks the fastest path for them (eager steps); ``plan_graph()`` reads
nothing: it binds fixed-capacity device lists (written in the graph at every replay) to the fused
decode with split counts from the batch size alone and buffers kept per batch size, so a CUDA graph
captured over its ``run()`` calls serves any later lists.

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
mixed shapes (docs/results/kernels.md). The choice and the split counts are
``heuristics.choose_path`` (pure, CPU-tested), its waves counted in the device's SMs.
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import flashinfer
import torch
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import is_power_of_two

from .common import key_centroids_fp16
from .fp8_decode import FP8_BUILD_OPTIONS, fp8_decode_kernel
from .heuristics import (
    FP8_KERNELS,
    TWO_PAGE_STEP_MIN_PAGES,
    DecodePath,
    choose_path,
    device_sm_count,
    fp8_tile_config,
    fused_build_of,
    graph_splits,
    tile_config,
    tilelang_fp8_applies,
)
from .mixed_decode import mixed_decode_kernel
from .rotation_merge import FP8_STATES, mixed_epilogue_kernel, rotate_queries_kernel, tq3_merge_splits
from .split_decode import TQ3_BUILD_OPTIONS
from .tq3_decode import tq3_decode_kernel


def _build_overrides(name: str, config: dict[str, int] | None, options: tuple[str, ...]) -> dict[str, int]:
    """A kernel's build options given by the caller (``name``), checked against the ones it takes."""
    config = config or {}
    if unknown := set(config) - set(options):
        raise ValueError(f"{name}: unknown options {sorted(unknown)}, the kernel takes {options}")
    return config


def _build_key(build: dict[str, int]) -> tuple:
    """A kernel cache's key for a build (its options, in a fixed order)."""
    return tuple(sorted(build.items()))


def _built(kernels: dict[tuple, object], build: dict[str, int], make) -> object:
    """The kernel of ``build`` from the cache ``kernels``, made by ``make(**build)`` on first use."""
    key = _build_key(build)
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
        self.num_sms = device_sm_count(self.device)  # what the split rules count a wave in
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
        # plan_graph's buffers per (batch, splits): made once, kept while the wrapper lives
        self._graph_buffers: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
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
        has_fp8, has_tq3 = int(fp8_indptr[-1]) > 0, int(tq3_indptr[-1]) > 0
        max_fp8_pages = max(fp8_counts.tolist(), default=0)
        max_tq3_pages = max(tq3_counts.tolist(), default=0)
        tq3_build = {**tile_config(self.group_size, self.page_size, self.head_dim, batch), **self._tq3_config} if has_tq3 else None
        path = choose_path(
            self.fp8_kernel,
            batch=batch,
            num_kv_heads=self.num_kv_heads,
            group_size=self.group_size,
            head_dim=self.head_dim,
            page_size=self.page_size,
            fp8_page_size=self.fp8_page_size,
            num_fp8_pages=int(fp8_indptr[-1]),
            max_fp8_pages=max_fp8_pages,
            max_tq3_pages=max_tq3_pages,
            tq3_build=tq3_build,
            num_splits=num_splits,
            num_fp8_splits=num_fp8_splits,
            num_sms=self.num_sms,
        )
        use_fused, use_tilelang, fp8_parts = path.fused, path.tilelang_fp8, path.fp8_parts
        tq3_splits, fp8_splits = path.tq3_splits, path.fp8_splits
        fp8_build = (
            {**fp8_tile_config(self.fp8_page_size, self.head_dim, -(-max_fp8_pages // fp8_splits)), **self._fp8_config}
            if use_tilelang
            else None
        )
        # the kernels of the two builds, each compiled on first use (a failed build leaves the plan as it was)
        fp8_kernel = tq3_kernel = mixed_kernel = None
        if use_fused:
            mixed_kernel = _built(self._mixed_kernels, fused_build_of(tq3_build, self.page_size), self._make_mixed())
        if use_tilelang:
            fp8_kernel = _built(self._fp8_kernels, fp8_build, self._make_fp8())
        if has_tq3 and not use_fused:  # (a fused plan's TQ3 pages are its mixed kernel's)
            tq3_kernel = _built(self._tq3_kernels, tq3_build, self._make_tq3())
        # validated: from here on the wrapper's state changes
        self._bind(
            batch, path, tq3_build, fp8_build, fp8_kernel, tq3_kernel, mixed_kernel, has_fp8, has_tq3,
            fp8_indptr, fp8_page_ids, fp8_last_page_len, tq3_indptr, tq3_page_ids,
        )

    def plan_graph(
        self,
        fp8_indptr: torch.Tensor,
        fp8_page_ids: torch.Tensor,
        fp8_last_page_len: torch.Tensor,
        tq3_indptr: torch.Tensor,
        tq3_page_ids: torch.Tensor,
        *,
        max_pages: int,
    ) -> None:
        """Plan a batch for a CUDA graph: the same lists as ``plan``, but device tensors of fixed
        capacity (live entries first, as ``forward_plan.plan_forward`` writes them) that are read by
        the kernels only, at every replay: nothing here reads them, so nothing syncs and the graph
        serves whatever lists the tensors hold then. The path is the fused decode (FP8 pages of the
        TQ3 page size), its split counts from the batch size and ``max_pages`` (every request's bound
        in pages) alone (``heuristics.graph_splits``). The split and output buffers are made once per
        batch size and kept: a captured graph's addresses stay valid whatever ``plan`` runs between
        its replays."""
        if self.fp8_page_size != self.page_size:
            raise ValueError(
                f"plan_graph runs the fused decode: FP8 pages of the TQ3 page size {self.page_size}, got {self.fp8_page_size}"
            )
        batch = fp8_indptr.numel() - 1
        if tq3_indptr.numel() - 1 != batch or fp8_last_page_len.numel() != batch:
            raise ValueError(f"fp8_indptr has {batch} requests, tq3_indptr {tq3_indptr.numel() - 1}")
        for name, t in (("fp8_indptr", fp8_indptr), ("fp8_page_ids", fp8_page_ids), ("fp8_last_page_len", fp8_last_page_len),
                        ("tq3_indptr", tq3_indptr), ("tq3_page_ids", tq3_page_ids)):
            if t.device != self.device or t.dtype != torch.int32:
                raise ValueError(f"plan_graph: {name} must be int32 on {self.device} (read in place), got {t.dtype} on {t.device}")
        tq3_build = {**tile_config(self.group_size, self.page_size, self.head_dim, batch), **self._tq3_config}
        tq3_splits, fp8_splits = graph_splits(batch, self.num_kv_heads, max_pages, self.page_size, tq3_build, self.num_sms)
        mixed_kernel = _built(self._mixed_kernels, fused_build_of(tq3_build, self.page_size), self._make_mixed())
        path = DecodePath(fused=True, tilelang_fp8=False, tq3_splits=tq3_splits, fp8_splits=fp8_splits)
        self._bind(
            batch, path, tq3_build, None, None, None, mixed_kernel, True, True,
            fp8_indptr, fp8_page_ids, fp8_last_page_len, tq3_indptr, tq3_page_ids,
            buffers=self._graph_buffers.setdefault((batch, tq3_splits, fp8_splits), {}),
        )

    def _bind(
        self, batch, path, tq3_build, fp8_build, fp8_kernel, tq3_kernel, mixed_kernel, has_fp8, has_tq3,
        fp8_indptr, fp8_page_ids, fp8_last_page_len, tq3_indptr, tq3_page_ids, *, buffers: dict | None = None,
    ) -> None:
        """Make a validated plan the wrapper's: its kernels, page lists on the device and buffers
        (new ones, or those of ``buffers``, a graph's, made on its first use)."""
        self._tq3_build, self._tq3_kernel = tq3_build, tq3_kernel
        self._fp8_build, self._fp8_kernel = fp8_build, fp8_kernel
        self._mixed_kernel = mixed_kernel
        self._batch = batch
        self._has_fp8, self._has_tq3 = has_fp8, has_tq3
        dev, hq, d = self.device, self.num_qo_heads, self.head_dim
        kept = {} if buffers is None else buffers

        def buffer(name: str, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            if name not in kept:
                kept[name] = torch.empty(*shape, device=dev, dtype=dtype)
            return kept[name]

        self.fp8_plan = None
        if path.fp8_parts:
            splits = path.fp8_splits
            # a TileLang FP8 step of several pages reads up to pages_per_step - 1 ids past a split's last page
            padding = fp8_build["pages_per_step"] - 1 if path.tilelang_fp8 else 0
            ids = fp8_page_ids.to(dev, torch.int32)
            self.fp8_plan = FP8SplitPlan(
                page_indptr=fp8_indptr.to(dev, torch.int32),
                page_ids=torch.cat([ids, ids.new_zeros(padding)]) if padding else ids,
                last_page_len=fp8_last_page_len.to(dev, torch.int32),
                num_splits=splits,
                out_partial=buffer("fp8_out_partial", batch, hq, splits, d),
                lse_partial=buffer("fp8_lse_partial", batch, hq, splits),
            )
        elif has_fp8:
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
        if has_tq3:
            splits = path.tq3_splits
            self.tq3_plan = TQ3Plan(
                page_indptr=tq3_indptr.to(dev, torch.int32),
                page_ids=tq3_page_ids.to(dev, torch.int32),
                num_splits=splits,
                out_partial=buffer("tq3_out_partial", batch, hq, splits, d),
                lse_partial=buffer("tq3_lse_partial", batch, hq, splits),
                out=buffer("tq3_out", batch, hq, d),
                lse=buffer("tq3_lse", batch, hq),
                q_rot=buffer("q_rot", batch, hq, d, dtype=torch.float16),
            )
        self._out = buffer("out", batch, hq, d, dtype=self.q_dtype)
        self._lse = buffer("lse", batch, hq)
        self._fp8_out = buffer("fp8_out", batch, hq, d, dtype=self.q_dtype)
        self._fp8_lse = buffer("fp8_lse", batch, hq)

    def _make_tq3(self):
        shape = (self.num_kv_heads, self.group_size, self.head_dim)
        return partial(tq3_decode_kernel, *shape, self.page_size, self.sm_scale, key_centroids_fp16(self.head_dim))

    def _make_mixed(self):
        shape = (self.num_kv_heads, self.group_size, self.head_dim)
        cent = key_centroids_fp16(self.head_dim)
        return partial(mixed_decode_kernel, *shape, self.page_size, self.sm_scale, cent, self._dtype_name)

    def _make_fp8(self):
        shape = (self.num_kv_heads, self.group_size, self.head_dim)
        return partial(fp8_decode_kernel, *shape, self.fp8_page_size, self.sm_scale, self._dtype_name)

    def compile(self, max_workers: int = 8) -> int:
        """Build every kernel ``plan`` may pick under this wrapper's ``fp8_kernel``, side by side
        (nvcc runs in subprocesses), and FlashInfer's FP8 decode (its JIT module, by one plan and
        run over a one-page cache): afterwards no ``plan`` compiles, so a server builds before it
        serves, not inside its first decode step or a graph capture. It replaces the wrapper's plan
        (plan() again before run()). Returns the TileLang builds made (0 when all were built)."""
        g, p, d, fp8_p = self.group_size, self.page_size, self.head_dim, self.fp8_page_size
        choice = self.fp8_kernel
        jobs: list[tuple[dict, dict[str, int], object]] = []
        for batch in (1, None):  # tile_config's two TQ3 builds: one request, and batches
            tq3_build = {**tile_config(g, p, d, batch), **self._tq3_config}
            jobs.append((self._tq3_kernels, tq3_build, self._make_tq3()))
            if choice in ("auto", "fused") and fp8_p == p:
                jobs.append((self._mixed_kernels, fused_build_of(tq3_build, p), self._make_mixed()))
        if choice in ("auto", "tilelang") and tilelang_fp8_applies(g, fp8_p):
            for pages_per_split in (1, TWO_PAGE_STEP_MIN_PAGES):  # fp8_tile_config's one- and two-page steps
                jobs.append((self._fp8_kernels, {**fp8_tile_config(fp8_p, d, pages_per_split), **self._fp8_config}, self._make_fp8()))
        todo: dict[tuple, tuple[dict, dict[str, int], object]] = {}
        for cache, build, make in jobs:
            key = _build_key(build)
            if key not in cache:
                todo.setdefault((id(cache), key), (cache, build, make))
        with ThreadPoolExecutor(max(1, min(max_workers, len(todo)))) as pool:
            built = list(pool.map(lambda job: job[2](**job[1]), todo.values()))
        for (cache, build, _), kernel in zip(todo.values(), built):
            cache[_build_key(build)] = kernel
        self._compile_flashinfer()
        return len(todo)

    def _compile_flashinfer(self) -> None:
        """FlashInfer's FP8 decode JIT module (q dtype, e4m3 pages, head dim), by one plan and run."""
        dev, h, d = self.device, self.num_kv_heads, self.head_dim
        one = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        self._fp8.plan(
            one, one[:1], one[1:], self.num_qo_heads, h, d, self.fp8_page_size,
            q_data_type=self.q_dtype, kv_data_type=torch.float8_e4m3fn, sm_scale=self.sm_scale,
        )
        cache = torch.zeros(1, self.fp8_page_size, h, d, device=dev, dtype=torch.float8_e4m3fn)
        self._fp8.run(torch.zeros(1, self.num_qo_heads, d, device=dev, dtype=self.q_dtype), (cache, cache))
        # FlashInfer now holds this one-page plan, not the caller's: plan() again before run()
        self._has_fp8 = self._has_tq3 = False
        self.tq3_plan = self.fp8_plan = None

    @property
    def fp8_kernel(self) -> str:
        return self._fp8_kernel_choice

    @fp8_kernel.setter
    def fp8_kernel(self, choice: str) -> None:  # takes effect at the next plan()
        if choice not in FP8_KERNELS:
            raise ValueError(f"fp8_kernel={choice!r}: one of {FP8_KERNELS}")
        self._fp8_kernel_choice = choice

    def _run_fp8(self, q: torch.Tensor, fp8_kv_cache, *, k_scale=None, v_scale=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP8 part over the planned FP8 pages: FlashInfer's state (out [B, Hq, D], lse [B, Hq]
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
        if not (self._has_fp8 or self._has_tq3):
            raise RuntimeError("run() before plan() (or after compile(), which plans a batch of its own)")
        if not self._has_tq3:
            return self._run_fp8(q, fp8_kv_cache, k_scale=k_scale, v_scale=v_scale)
        if self._mixed_kernel is not None:
            self._rotate_queries(q, signs)
            self._fused_decode(q.contiguous(), fp8_kv_cache, tq3_pages, k_scale, v_scale)
            return self._finish(signs)
        main = torch.cuda.current_stream(self.device)
        overlap = self._has_fp8 and self.overlap_fp8
        if overlap:  # independent of the TQ3 part
            self._side_stream.wait_stream(main)
            with torch.cuda.stream(self._side_stream):
                self._run_fp8(q, fp8_kv_cache, k_scale=k_scale, v_scale=v_scale)
        self._rotate_queries(q, signs)
        self._split_decode(self.tq3_plan.q_rot, tq3_pages)
        if overlap:
            main.wait_stream(self._side_stream)
        elif self._has_fp8:
            self._run_fp8(q, fp8_kv_cache, k_scale=k_scale, v_scale=v_scale)
        return self._finish(signs)
