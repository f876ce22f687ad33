"""``minima``: SGLang attention over Minima's mixed FP8 / TQ3 cache with the fused GPU kernels.

Decode batches run ``minima_kernels.MinimaDecodeWrapper``: one plan per step from the forward plan
(``forward_plan.plan_forward``: the per-format CSR page lists ``minima_native``'s batched decode
reads too; only the op differs), then one launch sequence per layer over the pool's FP8 hot pages
and TQ3 pages, merged by LSE in the kernels' epilogue. Extend, chunked prefill and mixed batches take
``minima_native``'s torch path (the FlashInfer prefill over a mixed prefix is issue #16's next step).

This first form is eager: the wrapper sizes its buffers from the step's page counts (a host sync per
step), so servers run without CUDA graphs. Every kernel a plan may pick is built when the wrapper is
made (``MinimaDecodeWrapper.compile``), at the first decode of SGLang's start-up warm-up. A decode step the kernels cannot serve (head dims that
are not a power of two, GQA groups or page sizes they were not built for) is attended by the torch
path and counted as a fallback (``sglang:minima_fallbacks_total``). Scratch is measured on the torch
path only: the kernels decode in registers and shared memory, but the buffers the wrapper sizes per
plan are not counted in ``sglang:minima_peak_scratch_bytes`` yet.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from sglang_minima.layers.attention.minima_native_backend import MinimaNativeAttnBackend

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
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrapper = None  # built at the first decode layer: its head counts, dtype and scale are the layer's
        self._wrapper_key: tuple | None = None
        self._planned: bool | None = None  # this step: not planned yet, planned, or refused by the kernels

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        super().init_forward_metadata(forward_batch)
        self._planned = None  # planned at this step's first layer, once its shapes are known

    def _decode_batch(self, q: torch.Tensor, layer: RadixAttention) -> torch.Tensor:
        wrapper = self._wrapper_for(q, layer)
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
        pool = self.token_to_kv_pool
        q_dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        key = (q.shape[1], pool.head_num, pool.head_dim, pool.page_size, float(layer.scaling), q_dtype)
        if self._wrapper_key != key:
            try:
                from minima_kernels import MinimaDecodeWrapper

                self._wrapper = MinimaDecodeWrapper(
                    self._workspace, q.shape[1], pool.head_num, pool.head_dim, pool.page_size,
                    sm_scale=float(layer.scaling), q_dtype=q_dtype,
                )
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
