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
``heuristics.choose_path`` (pure, CPU-tested), its waves counted in the device's SMs; each path is
one small class of decode_paths.py, bound by ``plan()`` and run by ``run()``.
"""

from concurrent.futures import ThreadPoolExecutor
from functools import partial

import flashinfer
import torch
from sglang_minima.codec.layout import TQ3PageLayout
from sglang_minima.codec.rotation import is_power_of_two

from .common import key_centroids_fp16
from .decode_paths import (
    FlashInferFP8,
    FP8OnlyDecode,
    FP8SplitPlan,
    FusedDecode,
    Outputs,
    RotatedTQ3,
    TileLangFP8,
    TQ3Plan,
    TwoLaunchDecode,
)
from .fp8_decode import FP8_BUILD_OPTIONS, fp8_decode_kernel
from .heuristics import (
    FP8_KERNELS,
    DecodePath,
    choose_path,
    compile_builds,
    device_sm_count,
    fp8_tile_config,
    fused_build_of,
    graph_splits,
    tile_config,
)
from .mixed_decode import mixed_decode_kernel
from .rotation_merge import FP8_STATES, mixed_epilogue_kernel, rotate_queries_kernel
from .split_decode import TQ3_BUILD_OPTIONS
from .tq3_decode import tq3_decode_kernel

Decode = FP8OnlyDecode | TwoLaunchDecode | FusedDecode


def _build_overrides(name: str, config: dict[str, int] | None, options: tuple[str, ...]) -> dict[str, int]:
    """A kernel's build options given by the caller (``name``), checked against the ones it takes."""
    config = config or {}
    if unknown := set(config) - set(options):
        raise ValueError(f"{name}: unknown options {sorted(unknown)}, the kernel takes {options}")
    return config


def _build_key(build: dict[str, int]) -> tuple:
    """A kernel cache's key for a build (its options, in a fixed order)."""
    return tuple(sorted(build.items()))


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
    a captured graph. ``overlap_fp8``: the FP8 part of the two-launch path on a side stream. Both take
    effect at the next ``plan``.
    ``tq3_config``: build options of the TQ3 decode over ``tile_config``'s for the batch (e.g. warps,
    min_blocks; also the fused kernel's); ``fp8_config``: of the TileLang FP8 decode over
    ``fp8_tile_config``'s (e.g. pages_per_step). ``key_bits``: the TQ3 pages' key code width, 3 or 4
    (``--minima-key-bits``; docs/TQ3P.md): the TQ3 and fused decodes read it, the tile configs are
    3-bit keys', sized down for 4-bit keys' shared memory (a 32 KB key table and a fourth piece per key
    lane stream; ``heuristics.tile_config``), not yet timed on a GPU. ``key_center``: the TQ3 pages'
    keys are page-centered (``--minima-key-center``): the TQ3 and fused decodes add each page's q'.m.

    After ``plan``, ``decode`` is the bound path (decode_paths.py): its page lists (``tq3_plan``,
    ``fp8_plan``), kernels and outputs; ``path`` is the choice that made it.
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
        key_bits: int = 3,
        key_center: bool = False,
    ) -> None:
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if not is_power_of_two(head_dim):
            raise ValueError(f"head_dim={head_dim}: the TQ3 kernels need a power of two (Hadamard rotation)")
        dtype = {torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(q_dtype)
        if dtype is None:
            raise ValueError(f"q_dtype must be torch.bfloat16 or torch.float16, got {q_dtype}")
        self.num_qo_heads, self.num_kv_heads, self.head_dim = num_qo_heads, num_kv_heads, head_dim
        self.group_size = num_qo_heads // num_kv_heads
        self.page_size = page_size
        self.fp8_page_size = page_size if fp8_page_size is None else fp8_page_size
        self.sm_scale = head_dim**-0.5 if sm_scale is None else sm_scale
        self.q_dtype = q_dtype
        self._dtype_name = dtype
        self.layout = TQ3PageLayout(num_kv_heads, page_size, head_dim, key_bits, key_center)  # refuses other key_bits
        self._centroids = key_centroids_fp16(head_dim, key_bits)
        self.device = workspace.device
        self.num_sms = device_sm_count(self.device)  # what the split rules count a wave in
        self._flashinfer = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        self._rotate_kernel = rotate_queries_kernel(num_qo_heads, self.group_size, head_dim, dtype)
        self._epilogue = {
            state: mixed_epilogue_kernel(num_qo_heads, self.group_size, head_dim, state, dtype) for state in FP8_STATES
        }
        self._side_stream = torch.cuda.Stream(self.device)
        # the TileLang builds, each made by the first plan() that takes it (or by compile()), kept per
        # kernel: "tq3" (tile_config's for the batch, or overridden), "mixed" (the TQ3 build with an FP8
        # role), "fp8" (fp8_tile_config's for the split length, or overridden)
        self._tq3_config = _build_overrides("tq3_config", tq3_config, TQ3_BUILD_OPTIONS)
        self._fp8_config = _build_overrides("fp8_config", fp8_config, FP8_BUILD_OPTIONS)
        self._kernels: dict[str, dict[tuple, object]] = {"tq3": {}, "mixed": {}, "fp8": {}}
        self.overlap_fp8 = overlap_fp8
        self.fp8_kernel = fp8_kernel
        # plan_graph's buffers per (batch, splits): made once, kept while the wrapper lives
        self._graph_buffers: dict[tuple[int, int, int], dict[str, torch.Tensor]] = {}
        self.decode: Decode | None = None
        self.path: DecodePath | None = None
        self.tq3_build: dict[str, int] | None = None  # the bound plan's builds (None where a part is absent)
        self.fp8_build: dict[str, int] | None = None

    @property
    def fp8_kernel(self) -> str:
        return self._fp8_kernel_choice

    @fp8_kernel.setter
    def fp8_kernel(self, choice: str) -> None:  # takes effect at the next plan()
        if choice not in FP8_KERNELS:
            raise ValueError(f"fp8_kernel={choice!r}: one of {FP8_KERNELS}")
        self._fp8_kernel_choice = choice

    @property
    def builds(self) -> dict[str, int]:
        """The TileLang builds made so far, per kernel ("tq3", "mixed", "fp8")."""
        return {kernel: len(cache) for kernel, cache in self._kernels.items()}

    @property
    def tq3_plan(self) -> TQ3Plan | None:
        """The bound plan's TQ3 page lists and split buffers (None without TQ3 pages)."""
        return None if self.decode is None else self.decode.tq3_plan

    @property
    def fp8_plan(self) -> FP8SplitPlan | None:
        """The bound plan's FP8 lists and split buffers, where its FP8 part gives split partials."""
        return None if self.decode is None else self.decode.fp8_plan

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
        splits per (request, kv head) of the TQ3 part / the FP8 split part (default: the heuristics')."""
        batch = fp8_indptr.numel() - 1
        if tq3_indptr.numel() - 1 != batch:
            raise ValueError(f"fp8_indptr has {batch} requests, tq3_indptr {tq3_indptr.numel() - 1}")
        fp8_counts = fp8_indptr[1:] - fp8_indptr[:-1]
        tq3_counts = tq3_indptr[1:] - tq3_indptr[:-1]
        if bool(((fp8_counts + tq3_counts) == 0).any()):
            raise ValueError("every request needs at least one FP8 or TQ3 page")
        num_fp8_pages, has_tq3 = int(fp8_indptr[-1]), int(tq3_indptr[-1]) > 0
        max_fp8_pages = max(fp8_counts.tolist(), default=0)
        tq3_build = {**self._tile_config(batch), **self._tq3_config} if has_tq3 else None
        path = choose_path(
            self.fp8_kernel,
            batch=batch,
            num_kv_heads=self.num_kv_heads,
            group_size=self.group_size,
            head_dim=self.head_dim,
            page_size=self.page_size,
            fp8_page_size=self.fp8_page_size,
            num_fp8_pages=num_fp8_pages,
            max_fp8_pages=max_fp8_pages,
            max_tq3_pages=max(tq3_counts.tolist(), default=0),
            tq3_build=tq3_build,
            num_splits=num_splits,
            num_fp8_splits=num_fp8_splits,
            num_sms=self.num_sms,
        )
        fp8_build = None
        if path.tilelang_fp8:
            pages_per_split = -(-max_fp8_pages // path.fp8_splits)
            fp8_build = {**fp8_tile_config(self.fp8_page_size, self.head_dim, pages_per_split), **self._fp8_config}
        # kernels are built before anything is bound: a failed build leaves the plan as it was
        kernels = self._path_kernels(path, has_tq3, tq3_build, fp8_build)
        lists = (fp8_indptr, fp8_page_ids, fp8_last_page_len, tq3_indptr, tq3_page_ids)
        self._bind(batch, path, tq3_build, fp8_build, kernels, num_fp8_pages > 0, has_tq3, lists, {})

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
        lists = (fp8_indptr, fp8_page_ids, fp8_last_page_len, tq3_indptr, tq3_page_ids)
        batch = fp8_indptr.numel() - 1
        if tq3_indptr.numel() - 1 != batch or fp8_last_page_len.numel() != batch:
            raise ValueError(f"fp8_indptr has {batch} requests, tq3_indptr {tq3_indptr.numel() - 1}")
        names = ("fp8_indptr", "fp8_page_ids", "fp8_last_page_len", "tq3_indptr", "tq3_page_ids")
        for name, t in zip(names, lists):
            if t.device != self.device or t.dtype != torch.int32:
                raise ValueError(f"plan_graph: {name} must be int32 on {self.device} (read in place), got {t.dtype} on {t.device}")
        tq3_build = {**self._tile_config(batch), **self._tq3_config}
        tq3_splits, fp8_splits = graph_splits(
            batch, self.num_kv_heads, max_pages, self.page_size, tq3_build, self.num_sms, head_dim=self.head_dim
        )
        path = DecodePath(fused=True, tilelang_fp8=False, tq3_splits=tq3_splits, fp8_splits=fp8_splits)
        kernels = self._path_kernels(path, True, tq3_build, None)
        buffers = self._graph_buffers.setdefault((batch, tq3_splits, fp8_splits), {})
        self._bind(batch, path, tq3_build, None, kernels, True, True, lists, buffers)

    def _path_kernels(self, path: DecodePath, has_tq3: bool, tq3_build, fp8_build) -> dict[str, object]:
        """The TileLang kernels a path launches, each built on first use."""
        kernels = {}
        if path.fused:
            kernels["mixed"] = self._built("mixed", fused_build_of(tq3_build, self.page_size))
        elif has_tq3:
            kernels["tq3"] = self._built("tq3", tq3_build)
        if path.tilelang_fp8:
            kernels["fp8"] = self._built("fp8", fp8_build)
        return kernels

    def _tile_config(self, batch: int) -> dict[str, int]:
        """``tile_config``'s TQ3 build for this geometry, key format and ``batch``."""
        return tile_config(self.group_size, self.page_size, self.head_dim, batch, self.layout.key_bits, self.layout.key_center)

    def _built(self, kernel: str, build: dict[str, int]) -> object:
        cache, key = self._kernels[kernel], _build_key(build)
        if key not in cache:
            cache[key] = self._maker(kernel)(**build)
        return cache[key]

    def _maker(self, kernel: str):
        """The TileLang kernel factory of ``kernel`` for this geometry, taking a build's options."""
        shape = (self.num_kv_heads, self.group_size, self.head_dim)
        center = {"key_center": True} if self.layout.key_center else {}  # (the default builds' cache keys unchanged)
        if kernel == "tq3":
            return partial(tq3_decode_kernel, *shape, self.page_size, self.sm_scale, self._centroids, **center)
        if kernel == "mixed":
            return partial(mixed_decode_kernel, *shape, self.page_size, self.sm_scale, self._centroids, self._dtype_name, **center)
        return partial(fp8_decode_kernel, *shape, self.fp8_page_size, self.sm_scale, self._dtype_name)

    def _bind(self, batch, path, tq3_build, fp8_build, kernels, has_fp8, has_tq3, lists, kept) -> None:
        """Make a validated plan the wrapper's: its page lists on the device and the path object over
        them, with buffers taken from ``kept`` (a graph's, made on first use; a fresh dict otherwise)."""
        fp8_indptr, fp8_page_ids, fp8_last_page_len, tq3_indptr, tq3_page_ids = lists
        dev, hq, d = self.device, self.num_qo_heads, self.head_dim

        def buffer(name: str, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            if name not in kept:
                kept[name] = torch.empty(*shape, device=dev, dtype=dtype)
            return kept[name]

        def i32(t: torch.Tensor) -> torch.Tensor:
            return t.to(dev, torch.int32)

        out = Outputs(buffer("out", batch, hq, d, dtype=self.q_dtype), buffer("lse", batch, hq))
        fp8_out = Outputs(buffer("fp8_out", batch, hq, d, dtype=self.q_dtype), buffer("fp8_lse", batch, hq))
        fp8_split_plan = None
        if path.fp8_parts:
            # a TileLang FP8 step of several pages reads up to pages_per_step - 1 ids past a split's last page
            padding = fp8_build["pages_per_step"] - 1 if path.tilelang_fp8 else 0
            ids = i32(fp8_page_ids)
            fp8_split_plan = FP8SplitPlan(
                page_indptr=i32(fp8_indptr),
                page_ids=torch.cat([ids, ids.new_zeros(padding)]) if padding else ids,
                last_page_len=i32(fp8_last_page_len),
                num_splits=path.fp8_splits,
                out_partial=buffer("fp8_out_partial", batch, hq, path.fp8_splits, d),
                lse_partial=buffer("fp8_lse_partial", batch, hq, path.fp8_splits),
            )
        elif has_fp8:
            self._flashinfer.plan(
                i32(fp8_indptr), i32(fp8_page_ids), i32(fp8_last_page_len),
                self.num_qo_heads, self.num_kv_heads, self.head_dim, self.fp8_page_size,
                q_data_type=self.q_dtype, kv_data_type=torch.float8_e4m3fn, sm_scale=self.sm_scale,
            )
        if not has_tq3:
            decode: Decode = FP8OnlyDecode(FlashInferFP8(self._flashinfer, out))
        else:
            tq3 = RotatedTQ3(
                TQ3Plan(
                    page_indptr=i32(tq3_indptr),
                    page_ids=i32(tq3_page_ids),
                    num_splits=path.tq3_splits,
                    out_partial=buffer("tq3_out_partial", batch, hq, path.tq3_splits, d),
                    lse_partial=buffer("tq3_lse_partial", batch, hq, path.tq3_splits),
                    q_rot=buffer("q_rot", batch, hq, d, dtype=torch.float16),
                ),
                self._rotate_kernel,
                self._epilogue,
                out,
            )
            if path.fused:
                decode = FusedDecode(kernels["mixed"], tq3, fp8_split_plan)
            else:
                fp8 = (
                    TileLangFP8(kernels["fp8"], fp8_split_plan) if path.tilelang_fp8
                    else FlashInferFP8(self._flashinfer, fp8_out) if has_fp8
                    else None
                )
                decode = TwoLaunchDecode(tq3, kernels["tq3"], fp8, fp8_out, self._side_stream, self.overlap_fp8)
        self.decode, self.path, self.tq3_build, self.fp8_build = decode, path, tq3_build, fp8_build

    def compile(self, max_workers: int = 8) -> int:
        """Build every kernel ``plan`` may pick under this wrapper's ``fp8_kernel``
        (``heuristics.compile_builds``), side by side (nvcc runs in subprocesses), and FlashInfer's FP8
        decode (its JIT module, by one plan and run over a one-page cache): afterwards no ``plan``
        compiles, so a server builds before it serves, not inside its first decode step or a graph
        capture. It unbinds the wrapper's plan (plan() again before run()). Returns the TileLang
        builds made (0 when all were built)."""
        builds = compile_builds(
            self.fp8_kernel, self.group_size, self.page_size, self.head_dim, self.fp8_page_size,
            self._tq3_config, self._fp8_config, self.layout.key_bits, self.layout.key_center,
        )
        todo = [(kernel, build) for kernel, build in builds if _build_key(build) not in self._kernels[kernel]]
        with ThreadPoolExecutor(max(1, min(max_workers, len(todo)))) as pool:
            made = list(pool.map(lambda job: self._maker(job[0])(**job[1]), todo))
        for (kernel, build), made_kernel in zip(todo, made):
            self._kernels[kernel][_build_key(build)] = made_kernel
        self._compile_flashinfer()
        return len(todo)

    def _compile_flashinfer(self) -> None:
        """FlashInfer's FP8 decode JIT module (q dtype, e4m3 pages, head dim), by one plan and run."""
        dev, h, d = self.device, self.num_kv_heads, self.head_dim
        one = torch.tensor([0, 1], dtype=torch.int32, device=dev)
        self._flashinfer.plan(
            one, one[:1], one[1:], self.num_qo_heads, h, d, self.fp8_page_size,
            q_data_type=self.q_dtype, kv_data_type=torch.float8_e4m3fn, sm_scale=self.sm_scale,
        )
        cache = torch.zeros(1, self.fp8_page_size, h, d, device=dev, dtype=torch.float8_e4m3fn)
        self._flashinfer.run(torch.zeros(1, self.num_qo_heads, d, device=dev, dtype=self.q_dtype), (cache, cache))
        # FlashInfer now holds this one-page plan, not the caller's: plan() again before run()
        self.decode = self.path = self.tq3_build = self.fp8_build = None

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
        if self.decode is None:
            raise RuntimeError("run() before plan() (or after compile(), which plans a batch of its own)")
        return self.decode.run(q, fp8_kv_cache, tq3_pages, signs, k_scale, v_scale)
