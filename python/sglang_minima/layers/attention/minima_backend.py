"""``minima``: SGLang attention over Minima's mixed FP8 / TQ3 cache with the fused GPU kernels.

Decode batches run ``minima_kernels.MinimaDecodeWrapper``: one plan per step from the forward plan
(``forward_plan.plan_forward``: the per-format CSR page lists ``minima_native``'s batched decode
reads too; only the op differs), then one launch sequence per layer over the pool's FP8 hot pages
and TQ3 pages, merged by LSE in the kernels' epilogue. Extend, chunked prefill and mixed batches run
``minima_kernels.MinimaPrefillWrapper`` over a split of each request's keys (``plan.ExtendPlan``):
FlashInfer over the new tokens (causal) and the FP8 hot prefix, the TQ3 prefix in bounded tiles, one
LSE merge. The split is made from the forward plan (``forward_plan.split_extend``, equal to the
per-request ``plan.plan_extend`` but that neighbours reading the same TQ3 pages share one segment:
one host read per step, each request's TQ3 page count and last TQ3 page, none while the pool holds
no TQ3 page) and the
step's routes are counted on the device; a batch the split refuses takes the torch path and counts
as a fallback.

Stale keys may be 3- or 4-bit (``--minima-key-bits``): both wrappers are built for the pool's width.

Eager steps plan on the host (``MinimaDecodeWrapper.plan``: the page counts pick the fastest path,
a host sync per step). Decode batches up to SGLang's ``--cuda-graph-max-bs`` run as CUDA graphs
(``--cuda-graph-backend-decode full``, the launcher's default here): ``init_forward_metadata_in_graph``
writes the forward plan inside the graph, over the model's whole context (fixed shapes), at every
replay from the live page table, and the first layer binds it with ``plan_graph`` (the fused decode,
split counts from the batch size, buffers kept per batch size): nothing is read back, so a replay
serves whatever the page table holds then: pages converted between replays, new pages, padding
rows. Its route counters are summed on the device (mem_cache/device_routes.py). Every kernel a plan
may pick is built when the wrapper is made (``MinimaDecodeWrapper.compile``), at the first decode
of SGLang's start-up warm-up. An eager decode step the kernels cannot serve (head dims that are not
a power of two, GQA groups or page sizes they were not built for) is attended by the torch path and
counted as a fallback (``sglang:minima_fallbacks_total``, one per step); such a model cannot be captured, and its
capture stops the server naming the flag. Scratch is measured on the torch path only: the kernels
decode in registers and shared memory, but the wrapper's split buffers are not counted in
``sglang:minima_peak_scratch_bytes`` yet.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from sglang.srt.layers.attention.base_attn_backend import SharedReadEnds
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_minima.layers.attention.forward_plan import plan_forward, split_extend
from sglang_minima.layers.attention.minima_native_backend import BatchedDecode, MinimaNativeAttnBackend, check_layer
from sglang_minima.layers.attention.plan import BatchRoute, ExtendPlan, plan_batch
from sglang_minima.ops import scratch
from sglang_minima.ops.host_copy import to_device

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

WORKSPACE_BYTES = 128 << 20
"""FlashInfer's decode workspace (its split-KV scratch), allocated once per backend."""


class MinimaAttnBackend(MinimaNativeAttnBackend):
    """Fused TileLang / FlashInfer decode over MinimaKVPool (CUDA); the torch path for the rest."""

    def __init__(self, model_runner: ModelRunner):
        super().__init__(model_runner)
        if torch.device(self.device).type != "cuda":
            raise ValueError("--attention-backend minima runs the GPU kernels: on CPU use minima_native")
        pool = self.token_to_kv_pool
        if pool.hot_k_buffer(pool.start_layer).dtype != torch.uint8:
            raise ValueError(
                "--attention-backend minima reads FP8 hot pages; with --minima-hot-dtype auto use minima_native"
            )
        if unread := pool.layout.kernel_unread:
            raise ValueError(
                f"--attention-backend minima: the kernels do not read {' or '.join(unread)}; use minima_native"
            )
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrapper = None  # built at the first decode layer: its head counts, dtype and scale are the layer's
        self._wrapper_key: tuple | None = None
        self._planned: bool | None = None  # this step: not planned yet, planned, or refused by the kernels
        self._prefill = None  # the extend wrapper, built at the first extend layer (its shapes are the layer's)
        self._prefill_key: tuple | None = None
        self._extend: ExtendPlan | None = None  # this extend step's split, None: the torch path attends it
        # Every layer of the last extend step ran the kernels, none the torch path (which plans at its
        # layer): a model whose layers all bring their own K/V (not Gemma-3n's KV-shared layers)
        self._kernel_extends = False
        self._torch_layers = False  # this step: some layer ran the torch path

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._planned = None  # planned at this step's first layer, once its shapes are known
        self._extend = None
        self._torch_layers = False
        self.token_to_kv_pool.prepare_write(None)  # translated at the first layer, unless the plan below does
        mode = forward_batch.forward_mode
        extend = mode == ForwardMode.EXTEND or mode.is_mixed()
        if extend and not self._score_pages:
            with torch.profiler.record_function("minima.plan"):
                if self._plan_extend(forward_batch):
                    return
        super().init_forward_metadata(forward_batch)

    def _plan_extend(self, forward_batch: ForwardBatch) -> bool:
        """The extend split on the device (one host read for the batch) and its route counts on the
        device; False where the split refuses the batch (then the torch path plans and attends it)."""
        pool, p = self.token_to_kv_pool, self.token_to_kv_pool.page_size
        q_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
        kv_lens = _host_seq_lens(forward_batch)
        plan = plan_forward(
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens,
            to_device(q_lens, torch.int32, forward_batch.seq_lens.device), pool.page_table.fmt, pool.page_table.phys, p,
            max(-(-k // p) for k in kv_lens),
        )
        try:
            # no TQ3 page held (Stale disabled, or none converted yet): no host read, no wait for the device
            self._extend = split_extend(plan, q_lens, kv_lens, tq3_possible=pool.holds_tq3_pages)
        except ValueError as e:  # this step only: the torch path masks by position
            logger.warning("minima: extend step on the torch path: %s", e)
            return False
        every = torch.ones(plan.batch_size, dtype=torch.bool, device=plan.kv_lens.device)
        pool.note_read_on_device(plan.logical_pages, plan.token_counts(), every)
        pool.note_device_step()
        pool.prepare_write(forward_batch.out_cache_loc)  # before the read-done event (PRE_REPLAY)
        self.forward_metadata = plan
        return True

    def _snapshot_prefill_shared_reads(self, forward_batch: ForwardBatch, *, num_qo_tokens: int) -> SharedReadEnds:
        """Where an extend step's reads of scheduler-shared state end, for SGLang's overlap scheduler
        (its prefill read-done fast path): PRE_REPLAY where the kernels attend the step from the plan
        made above, so the schedule stream (SGLang's next batch, Minima's tick) waits for the plan,
        not the whole extend. After the plan the step reads the plan's own tensors and the pages it
        names (the release quarantine keeps a freed one for two steps); its KV write slots were
        translated at the plan too (``MinimaKVPool.prepare_write``), so a page SGLang frees and maps
        again meanwhile (a chunked request's duplicate pages, an abort) is written at the physical page
        the step planned, whose fill it raises (``PageTable.hot_fill``), not the new owner's. The tick
        reads one thing the step writes: that fill, raised after the last layer's write; a fill read
        before that leaves the page unsealed, converted at a later tick. UNKNOWN (the whole
        forward) where a layer may take the torch path, which plans at its layer: no split this step
        (score Anchors, or the split refused), or a layer of the last extend step took it (SGLang's
        warm-up is the first); and with the observation window, whose mass the tick reads."""
        if self._extend is None or not self._kernel_extends or self._window:
            return SharedReadEnds.UNKNOWN
        return SharedReadEnds.PRE_REPLAY

    def _torch_route(self, forward_batch: ForwardBatch) -> BatchRoute:
        """The per-request routes the torch path reads, for an extend step planned on the device that
        the kernels cannot serve after all (its routes are counted already)."""
        pool = self.token_to_kv_pool
        return plan_batch(
            self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices.tolist(),
            _host_seq_lens(forward_batch), [int(n) for n in forward_batch.extend_seq_lens_cpu],
            pool.page_table.fmt, pool.page_table.phys, pool.page_size,
        )

    # ------------------------------------------------------------------ extend / prefill

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
        prefill = self._prefill_for(q, layer) if self._extend is not None and k is not None else None
        last = layer.layer_id == self._last_layer_id
        if prefill is None:
            self._torch_layers = True
            if not isinstance(self.forward_metadata, BatchRoute):
                self.forward_metadata = self._torch_route(forward_batch)
            if last:
                self.token_to_kv_pool.note_fallback()  # once per step: the torch path attended this batch
                self._kernel_extends = False
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        if last:
            self._kernel_extends = not self._torch_layers
        check_layer(layer)
        pool, lid, plan = self.token_to_kv_pool, self._pool_layer(layer), self._extend
        if self._planned is None:
            with torch.profiler.record_function("minima.kernel_plan"):
                prefill.plan(plan.qo_indptr, plan.prefix_indptr, plan.prefix_slots, plan.prefix_rows, self._tq3_segments(plan))
            self._planned = True
        h, d = pool.head_num, pool.head_dim
        hot = (
            pool.hot_k_buffer(lid).view(torch.float8_e4m3fn).view(-1, 1, h, d),
            pool.hot_v_buffer(lid).view(torch.float8_e4m3fn).view(-1, 1, h, d),
        )
        with scratch.measure() as meter, torch.profiler.record_function("minima.prefill_kernels"):
            o = prefill.run(
                q.view(-1, layer.tp_q_head_num, layer.qk_head_dim), k.view(-1, h, d), v.view(-1, h, d), hot,
                pool.tq3_buffer(lid), pool.layout, pool.codebook, pool.rotation(lid),
                k_scale=pool.k_scale(lid), v_scale=pool.v_scale(lid),
            )
        pool.note_scratch_bytes(meter.peak_bytes)
        if save_kv_cache:  # after the attention, which reads k and v themselves: the FP8 write divides them by the scales in place
            self._write_kv(layer, forward_batch, k, v)
        return o.to(q.dtype).reshape(o.shape[0], -1)

    @staticmethod
    def _tq3_segments(plan: ExtendPlan):
        from minima_kernels.prefill import Tq3Segment

        return tuple(Tq3Segment(t.q_start, t.q_len, t.pages) for t in plan.tq3)

    def _prefill_for(self, q: torch.Tensor, layer: RadixAttention):
        """The extend wrapper for this layer's shapes, or None where FlashInfer does not build for them."""
        key = self._kernel_key(q, layer)
        if self._prefill_key != key:
            try:
                from minima_kernels.prefill import MinimaPrefillWrapper

                self._prefill = self._make_wrapper(MinimaPrefillWrapper, key)
            except (ValueError, NotImplementedError, RuntimeError) as e:
                logger.warning("minima: extend on the torch path, the prefill does not build for %s: %s", key, e)
                self._prefill = None
            self._prefill_key = key
            self._planned = None
        return self._prefill

    # ------------------------------------------------------------------ CUDA graphs (decode)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        # a graph's plan covers the longest context SGLang admits (req_to_token's width), in pages
        self._graph_max_pages = -(-self.req_to_token_pool.req_to_token.shape[1] // self.token_to_kv_pool.page_size)
        self._graph_plans: dict[int, BatchedDecode] = {}  # the plans captured graphs read (kept alive)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1  # a padding row reads one token of page 0 (forward_plan.py)

    def init_forward_metadata_out_graph(self, forward_batch: ForwardBatch, in_capture: bool = False) -> None:
        """Host side of a captured step (before capture and before every replay): nothing to plan
        here, the plan is written inside the graph; its device route counts are new."""
        if not forward_batch.forward_mode.is_decode():
            raise NotImplementedError(
                f"--attention-backend minima captures decode batches only, got {forward_batch.forward_mode.name}"
            )
        self.token_to_kv_pool.note_device_step()

    def init_forward_metadata_in_graph(self, forward_batch: ForwardBatch) -> None:
        """The forward plan, recorded in the graph: fixed shapes over the model's whole context,
        read from the live page table at every replay."""
        with torch.profiler.record_function("minima.plan"):
            pool = self.token_to_kv_pool
            seq_lens = forward_batch.seq_lens
            plan = plan_forward(
                self.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, seq_lens,
                torch.ones_like(seq_lens), pool.page_table.fmt, pool.page_table.phys, pool.page_size,
                self._graph_max_pages,
            )
            rows = forward_batch.req_pool_indices != 0  # req_to_token row 0: SGLang's padding rows
            pool.note_read_on_device(plan.logical_pages, plan.token_counts(rows), rows)
            pool.prepare_write(forward_batch.out_cache_loc)  # before the graph's marker (IN_REPLAY)
        self.forward_metadata = BatchedDecode(plan, None, None)
        self._planned = None  # bound to the wrapper at the first layer (each warm-up and the capture)
        if torch.cuda.is_current_stream_capturing():
            self._graph_plans[plan.batch_size] = self.forward_metadata

    def _decode_batch(self, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        wrapper = self._wrapper_for(q, layer)
        if self.forward_metadata.in_graph:
            return self._decode_in_graph(wrapper, q, layer)
        if wrapper is not None and self._planned is None:
            plan = self.forward_metadata.plan
            try:
                with torch.profiler.record_function("minima.kernel_plan"):
                    wrapper.plan(plan.hot.indptr, plan.hot.pages, plan.hot_last_page_len, plan.tq3.indptr, plan.tq3.pages)
                self._planned = True
            except (ValueError, NotImplementedError) as e:  # a batch the kernels' rules refuse: this step only
                logger.warning("minima: decode step on the torch path: %s", e)
                self._planned = False
        if wrapper is None or not self._planned:
            if layer.layer_id == self._last_layer_id:
                self.token_to_kv_pool.note_fallback()  # once per step: the torch path attended this batch
            return super()._decode_batch(q, layer)
        return self._run_kernels(wrapper, q, layer)

    def _decode_in_graph(self, wrapper, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        """A captured step's layer: the plan written in the graph, bound once per step (no host read)."""
        if wrapper is None:
            raise NotImplementedError(
                "--cuda-graph-backend-decode full: the minima kernels do not build for this model's attention "
                "(see the warning above); serve it with --cuda-graph-backend-decode disabled"
            )
        if self._planned is None:
            plan = self.forward_metadata.plan
            wrapper.plan_graph(
                plan.hot.indptr, plan.hot.pages, plan.hot_last_page_len, plan.tq3.indptr, plan.tq3.pages,
                max_pages=plan.max_pages,
            )
            self._planned = True
        return self._run_kernels(wrapper, q, layer)

    def _run_kernels(self, wrapper, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        pool, lid = self.token_to_kv_pool, self._pool_layer(layer)
        h, d, ps = pool.head_num, pool.head_dim, pool.page_size
        k = pool.hot_k_buffer(lid).view(torch.float8_e4m3fn).view(-1, ps, h, d)
        v = pool.hot_v_buffer(lid).view(torch.float8_e4m3fn).view(-1, ps, h, d)
        with torch.profiler.record_function("minima.decode_kernels"):
            out, _ = wrapper.run(
                q.to(wrapper.q_dtype).contiguous(), (k, v), pool.tq3_buffer(lid), pool.rotation(lid).signs,
                k_scale=pool.k_scale(lid), v_scale=pool.v_scale(lid),
            )
            return out.clone()  # the wrapper's output buffer is the next layer's too

    def _wrapper_for(self, q: torch.Tensor, layer: RadixAttention):
        """The decode wrapper for this layer's shapes, or None where the kernels do not build for them."""
        key = self._kernel_key(q, layer)
        if self._wrapper_key != key:
            try:
                from minima_kernels import MinimaDecodeWrapper

                self._wrapper = self._make_wrapper(MinimaDecodeWrapper, key)
            except (ValueError, NotImplementedError) as e:
                logger.warning("minima: decode on the torch path, the kernels do not build for %s: %s", key, e)
                self._wrapper = None
            else:
                # every build a plan may pick, now: SGLang's first forward of these shapes is its warm-up
                # (or a graph capture's warm-up run), not a request's decode step
                t0 = time.perf_counter()
                made = self._wrapper.compile()
                logger.info("minima: %d decode kernels built for %s in %.1f s", made, key, time.perf_counter() - t0)
            self._wrapper_key = key
            self._planned = None
        return self._wrapper

    def _kernel_key(self, q: torch.Tensor, layer: RadixAttention) -> tuple:
        """What a kernel wrapper is built for: (query heads, KV heads, head dim, page size, scale, query dtype)."""
        pool = self.token_to_kv_pool
        q_dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        return (layer.tp_q_head_num, pool.head_num, pool.head_dim, pool.page_size, float(layer.scaling), q_dtype)

    def _make_wrapper(self, cls, key: tuple):
        """MinimaDecodeWrapper or MinimaPrefillWrapper for ``_kernel_key``'s geometry and the pool's
        key width (they share the workspace)."""
        num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale, q_dtype = key
        return cls(
            self._workspace, num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale=sm_scale, q_dtype=q_dtype,
            key_bits=self.token_to_kv_pool.layout.key_bits, key_center=self.token_to_kv_pool.layout.key_center,
        )


def _host_seq_lens(forward_batch: ForwardBatch) -> list[int]:
    """The batch's sequence lengths on the host (SGLang's host copy; read back only where it has none)."""
    seq_lens = forward_batch.seq_lens_cpu
    return (seq_lens if seq_lens is not None else forward_batch.seq_lens.cpu()).tolist()
