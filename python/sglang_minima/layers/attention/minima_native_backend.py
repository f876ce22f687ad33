"""``minima_native``: SGLang attention over Minima's mixed FP8 / TQ3 paged KV cache, in torch.

The CPU backend and the reference for every faster path. Per forward step, ``init_forward_metadata``
turns the ForwardBatch and the pool's page table into per-request routes (plan.py): hot token slots
and TQ3 page ids with their sequence positions. Per layer, each request's queries attend its hot
tokens and its TQ3 pages in tiles (sglang_minima.ops.paged: no dense copy of the cache) and the two
partial (out, LSE) states are merged by the online-softmax merge. Extend, chunked prefill (later
chunks read Stale pages of earlier ones) and mixed batches take this path: queries sit at the last
positions of their request and mask keys by position. Decode batches (one query per request) are
planned for the whole batch at once (forward_plan.py, the per-format CSR page lists the GPU backend
reads too) and attended in one pass per tile of pages (ops.batched_decode; on CPU its lookup-table
twin ops.lut_decode), unless page scores are collected for score Anchors, which take the
per-request path.

Contract with the pool (MinimaKVPool): the page table maps every page of the batch before the
forward (the allocator maps new pages at allocation, always to hot pages). ``note_read`` is told the
logical pages each forward reads, once per step, and counts the routes (pages and tokens attended
per format); it takes no reference: a physical page freed while a forward may still read it waits
in the pool's release quarantine (mem_cache/physical_pool.py). There is no dense fallback and no
dense copy of a compressed page: every read goes through the tiled ops, and each layer's call tells
the pool its scratch high-water mark (``note_scratch_bytes``: decoded tiles and scores, measured by
ops.scratch).
With ``--minima-attention-score-anchors``, the backend also sums each page's attention mass over the
layers of a step (page_mass.py) and reports it after the last layer (``note_page_scores``). With
``--minima-anchor-window N``, extend steps sum only the mass of each request's last N queries in the
step (the observation window, the prompt's close in the chunk that ends it) and report it with
``note_window_mass``; decode steps collect nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_minima.layers.attention.forward_plan import ForwardPlan, plan_forward
from sglang_minima.layers.attention.page_mass import hot_token_mass, tq3_page_mass
from sglang_minima.layers.attention.plan import BatchRoute, RequestRoute, RouteCounts, plan_batch
from sglang_minima.ops import scratch
from sglang_minima.ops.batched_decode import mixed_batch_decode
from sglang_minima.ops.lut_decode import lut_mixed_batch_decode
from sglang_minima.ops.paged import (
    HotPagedKV,
    Tq3PagedKV,
    hot_paged_attention,
    mixed_paged_attention,
)

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


@dataclass(frozen=True)
class BatchedDecode:
    """A decode step planned for the whole batch: the plan, and what the pool is told it reads
    (None in a CUDA graph, whose plan is written at each replay and counted on the device)."""

    plan: ForwardPlan
    logical_pages: torch.Tensor | None
    """int64: the logical pages each request reads, concatenated in batch and position order."""
    counts: RouteCounts | None

    @property
    def in_graph(self) -> bool:
        return self.counts is None


class MinimaNativeAttnBackend(AttentionBackend):
    """Torch attention over MinimaKVPool: hot (FP8 or model dtype) + TQ3 pages, merged by LSE."""

    def __init__(self, model_runner: ModelRunner):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        kv_pool = model_runner.token_to_kv_pool
        # A hybrid (linear-attention) model's pool wraps the full-attention one (see the allocator).
        self.token_to_kv_pool = pool = getattr(kv_pool, "full_kv_pool", kv_pool)
        if not hasattr(pool, "page_table"):
            raise ValueError(
                f"--attention-backend minima_native reads Minima's KV pool, got {type(pool).__name__}: "
                "select Minima with --radix-cache-backend minima (sglang_minima.launch_server does)"
            )
        self.forward_metadata: BatchRoute | BatchedDecode | None = None
        # A hybrid (linear-attention) model's Minima pool holds only its full-attention layers, by
        # dense index; elsewhere the pool takes the model's layer ids.
        mapping = getattr(kv_pool, "full_attention_layer_id_mapping", None)
        self._pool_layer_ids: dict[int, int] | None = dict(mapping) if mapping is not None else None
        self._score_pages: bool = pool.minima_config.attention_score_anchors
        self._window: int = pool.minima_config.anchor_window
        """Extend steps collect the page mass of each request's last ``_window`` queries (0: none)."""
        self._window_ends: dict[int, int] = {}  # this step's req_pool_idx -> sequence length, with a window
        self._last_layer_id: int = (
            max(mapping) if mapping is not None else pool.start_layer + pool.layer_num - 1
        )
        # Per request of the current forward: attention mass of each page it reads, summed over layers.
        self._page_mass: list[torch.Tensor] = []

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        with torch.profiler.record_function("minima.plan"):  # a scope for profiles (benchmark/serving/profile_decode.py)
            self._init_forward_metadata(forward_batch)

    def _init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_metadata = BatchRoute(requests=())
            self._page_mass = []
            return
        if mode.is_decode():
            q_lens = [1] * forward_batch.batch_size
        elif mode == ForwardMode.EXTEND or mode.is_mixed():
            q_lens = list(forward_batch.extend_seq_lens_cpu)
        else:
            raise NotImplementedError(f"minima_native does not support forward mode {mode.name}")
        seq_lens = forward_batch.seq_lens_cpu
        if seq_lens is None:
            seq_lens = forward_batch.seq_lens.cpu()
        pool = self.token_to_kv_pool
        if mode.is_decode() and not self._score_pages:
            self.forward_metadata = self._plan_decode(forward_batch, seq_lens)
            counts = self.forward_metadata.counts
            pool.note_read(self.forward_metadata.logical_pages, hot_tokens=counts.hot_tokens, tq3_tokens=counts.tq3_tokens)
            return
        rows, lens = forward_batch.req_pool_indices.tolist(), seq_lens.tolist()
        route = plan_batch(
            self.req_to_token_pool.req_to_token,
            rows,
            lens,
            q_lens,
            pool.page_table.fmt,
            pool.page_table.phys,
            pool.page_size,
        )
        self.forward_metadata = route
        counts = route.counts
        pool.note_read(route.logical_pages, hot_tokens=counts.hot_tokens, tq3_tokens=counts.tq3_tokens)
        if self._window:
            # the window's end per request (a host fact): the controller pins a request's Anchors only
            # once a window reached its prompt's end (its allocation runs ahead of this forward under overlap)
            self._window_ends = dict(zip(rows, lens))
        if self._score_pages or (self._window and not mode.is_decode()):
            self._page_mass = [
                torch.zeros(r.logical_pages.numel(), dtype=torch.float32, device=r.logical_pages.device)
                for r in route.requests
            ]
        else:
            self._page_mass = []

    def _plan_decode(self, forward_batch: ForwardBatch, seq_lens_cpu: torch.Tensor) -> BatchedDecode:
        pool = self.token_to_kv_pool
        page_size = pool.page_size
        req_to_token = self.req_to_token_pool.req_to_token
        kv_lens = seq_lens_cpu.to(req_to_token.device)
        max_pages = max(1, -(-int(seq_lens_cpu.max()) // page_size))
        plan = plan_forward(
            req_to_token, forward_batch.req_pool_indices, kv_lens, torch.ones_like(kv_lens),
            pool.page_table.fmt, pool.page_table.phys, page_size, max_pages,
        )
        hot_tokens, tq3_tokens = plan.token_counts().tolist()
        counts = RouteCounts(
            hot_pages=int(plan.hot.indptr[-1]), hot_tokens=hot_tokens,
            tq3_pages=int(plan.tq3.indptr[-1]), tq3_tokens=tq3_tokens,
        )
        return BatchedDecode(plan, plan.read_pages(), counts)

    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
        **kwargs,
    ) -> torch.Tensor:
        return self._forward(q, k, v, layer, forward_batch, save_kv_cache)

    def support_triton(self) -> bool:
        return False

    def _forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool,
    ) -> torch.Tensor:
        check_layer(layer)
        if save_kv_cache and k is not None and v is not None:
            self._write_kv(layer, forward_batch, k, v)
        with scratch.measure() as meter:
            o = self._attend(q, layer)
        self.token_to_kv_pool.note_scratch_bytes(meter.peak_bytes)
        return o

    def _write_kv(self, layer: RadixAttention, forward_batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        # New tokens land in hot pages: the pool translates logical slots to hot physical slots. The
        # layer's FP8 scales as floats (a checkpoint's KV scales; None: 1), so the write reads no tensor back.
        self.token_to_kv_pool.set_kv_buffer(
            layer, KVWriteLoc(forward_batch.out_cache_loc), k, v,
            getattr(layer, "k_scale_float", None), getattr(layer, "v_scale_float", None),
            layer_id_override=self._pool_layer(layer),
        )

    def _attend(self, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        """This layer's attention output [T, Hq * Dv] (q's dtype) over the pool's pages."""
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if isinstance(self.forward_metadata, BatchedDecode):
            return self._decode_batch(q3, layer).to(q.dtype).reshape(q3.shape[0], -1)
        o = q.new_empty(q3.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        o3 = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        for i, route in enumerate(self.forward_metadata.requests):
            rows = slice(route.q_start, route.q_start + route.q_len)
            o3[rows] = self._attend_request(i, q3[rows], route, layer).to(o.dtype)
        if self._page_mass and layer.layer_id == self._last_layer_id:
            # Once per step, after the last layer: the mass of every page read, for score or window Anchors.
            pages, mass = self.forward_metadata.logical_pages, torch.cat(self._page_mass)
            if self._window:
                self.token_to_kv_pool.note_window_mass(pages, mass, self._window_ends)
            else:
                self.token_to_kv_pool.note_page_scores(pages, mass)
            self._page_mass = []
        return o

    def _pool_layer(self, layer: RadixAttention) -> int:
        """The id the Minima pool knows ``layer`` by."""
        return layer.layer_id if self._pool_layer_ids is None else self._pool_layer_ids[layer.layer_id]

    def _decode_batch(self, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        """Every request's one query [B, Hq, D] over its hot and TQ3 pages -> out fp32 [B, Hq, Dv]."""
        pool, plan, lid = self.token_to_kv_pool, self.forward_metadata.plan, self._pool_layer(layer)
        k_buffer = pool.hot_k_buffer(lid)
        fp8 = k_buffer.dtype == torch.uint8
        # On CPU the lookup-table op (ops/lut_decode.py: same result up to float rounding) is
        # 2-3x faster than the reference; elsewhere the reference runs.
        decode = lut_mixed_batch_decode if q.device.type == "cpu" else mixed_batch_decode
        out, _ = decode(
            q, plan.hot, plan.tq3, plan.kv_lens, k_buffer, pool.hot_v_buffer(lid), pool.tq3_buffer(lid),
            pool.layout, pool.codebook, pool.rotation(lid), layer.scaling,
            k_scale=pool.k_scale(lid) if fp8 else None, v_scale=pool.v_scale(lid) if fp8 else None,
        )
        return out

    def _attend_request(self, index: int, q: torch.Tensor, route: RequestRoute, layer: RadixAttention) -> torch.Tensor:
        """Request ``index``'s queries [T, Hq, D] over its hot tokens and TQ3 pages -> out fp32 [T, Hq, Dv]."""
        pool = self.token_to_kv_pool
        lid = self._pool_layer(layer)
        k_buffer, v_buffer = pool.hot_k_buffer(lid), pool.hot_v_buffer(lid)
        fp8 = k_buffer.dtype == torch.uint8
        hot = HotPagedKV(
            k_buffer,
            v_buffer,
            route.hot_slots,
            route.hot_positions,
            k_scale=pool.k_scale(lid) if fp8 else None,
            v_scale=pool.v_scale(lid) if fp8 else None,
        )
        # On CPU, where this backend serves, the fused kernel and no masks where the new tokens are the
        # last hot ones (always, in serving): 4x less time for a fresh 2K prompt. On CUDA it stays the device
        # tests' fp32 reference (the fused kernel there takes bf16).
        own_tail = route.own_tokens_hot and q.device.type == "cpu"
        q_positions = None if own_tail else route.q_positions
        tq3 = None
        if route.num_tq3_pages == 0:
            out, lse = hot_paged_attention(q, hot, layer.scaling, q_positions, own_tail=own_tail)
        else:
            tq3 = Tq3PagedKV(pool.tq3_buffer(lid), route.tq3_pages, pool.layout, pool.codebook, route.tq3_page_starts)
            out, lse = mixed_paged_attention(q, hot, tq3, pool.rotation(lid), layer.scaling, q_positions,
                                             own_tail=own_tail)
        if self._page_mass:
            rows = slice(max(0, q.shape[0] - self._window), None) if self._window else slice(None)
            self._add_page_mass(self._page_mass[index], q[rows], route.q_positions[rows], route, layer, hot, tq3,
                                lse[rows])
        return out

    def _add_page_mass(
        self,
        mass: torch.Tensor,
        q: torch.Tensor,
        q_positions: torch.Tensor,
        route: RequestRoute,
        layer: RadixAttention,
        hot: HotPagedKV,
        tq3: Tq3PagedKV | None,
        lse: torch.Tensor,
    ) -> None:
        """Add this layer's attention mass of the queries ``q`` (at ``q_positions``, with their merged
        ``lse``) per page to ``mass`` (indexed like ``route.logical_pages``: the k-th page of a request
        holds positions k*page_size .. (k+1)*page_size - 1)."""
        pool = self.token_to_kv_pool
        page_size = pool.page_size
        hot_mass = hot_token_mass(q, hot, layer.scaling, lse, q_positions)
        mass.index_add_(0, route.hot_positions // page_size, hot_mass)
        if tq3 is not None:
            q_rot = pool.rotation(self._pool_layer(layer)).rotate(q, head_axis=-2)
            tq3_mass = tq3_page_mass(q_rot, tq3, layer.scaling, lse, q_positions)
            mass.index_add_(0, route.tq3_page_starts // page_size, tq3_mass)


def check_layer(layer: RadixAttention) -> None:
    """Reject attention variants this backend does not implement (rather than compute them wrong)."""
    if layer.is_cross_attention or layer.attn_type != AttentionType.DECODER:
        raise NotImplementedError("minima_native supports causal decoder self-attention only")
    if layer.sliding_window_size > -1:
        raise NotImplementedError("minima_native does not support sliding-window attention")
    if layer.logit_cap > 0:
        raise NotImplementedError("minima_native does not support attention logit capping")
