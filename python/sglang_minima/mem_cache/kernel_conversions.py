"""The store's page conversions on CUDA: the TileLang kernels (``minima_kernels.PageConversions``).

The torch codec converts a batch of pages with ~400 small ops per layer (each a launch on the GPU:
~12,000 for a 30-layer model, the largest host cost of a decode step that converts); the kernels do
it in one launch per layer and write the codec's exact bytes both ways (tested bit for bit against
it: test/gpu/test_kernels.py; inside the store: test/mem_cache/test_kernel_conversions.py). Used
where they apply: a CUDA store with FP8 hot pages and a power-of-two head dim (the Hadamard
rotation), 3- or 4-bit keys (``--minima-key-bits``), the ``gpu`` extra installed.

Promotion (TQ3 -> FP8) re-quantizes with ``x / scale`` correctly rounded (``T.ieee_fdiv``), as the
codec's ``fp8_requantize`` does: a multiply by the reciprocal differs from it on e4m3 rounding ties
(119 bytes in one 256-dim test on the H200, 2026-12-02: docs/results/device/promote_ties_1607.log).
"""

from __future__ import annotations

import logging

import torch

from sglang_minima.codec.rotation import is_power_of_two

logger = logging.getLogger(__name__)


class KernelConversions:
    """FP8 <-> TQ3 for every layer of a batch of pages, one kernel launch per layer. ``store`` is a
    ``TieredPageStore`` (its shape, buffers, rotations and FP8 scales are read at each call)."""

    def __init__(self, store):
        s = store.shape
        from minima_kernels import PageConversions

        self.store = store
        self.kernels = PageConversions(s.num_kv_heads, s.page_size, s.head_dim, s.layout.key_bits, s.layout.key_center)
        # built (or loaded from TileLang's cache) now, not at the first conversion
        _ = self.kernels.encode_kernel, self.kernels.decode_kernel
        self._scales: list[tuple[tuple[float, float], torch.Tensor] | None] = [None] * s.num_layers

    def _layer_scales(self, layer: int) -> torch.Tensor:
        """fp32 [2] on the device: the layer's FP8 scales, copied once (SGLang sets them at load)."""
        key = (float(self.store.k_scales[layer]), float(self.store.v_scales[layer]))
        cached = self._scales[layer]
        if cached is None or cached[0] != key:
            # filled on the device (fill_ takes the value as a kernel argument): a host tensor's copy,
            # `scales[0] = k` included, would wait for the conversion stream, i.e. for the forward it
            # waits on, and a launch would no longer return before its copy ran
            scales = torch.empty(2, dtype=torch.float32, device=self.store.device)
            scales[:1].fill_(key[0])
            scales[1:].fill_(key[1])
            cached = (key, scales)
            self._scales[layer] = cached
        return cached[1]

    def _caches(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.store.shape
        view = (s.num_hot_pages + 1, s.page_size, s.num_kv_heads, s.head_dim)
        return self.store.hot_k[layer].view(view), self.store.hot_v[layer].view(view)

    def encode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Hot pages ``src`` -> TQ3 pages ``dst`` (device page ids), every layer."""
        src, dst = src.to(torch.int32), dst.to(torch.int32)
        for layer in range(self.store.shape.num_layers):
            k, v = self._caches(layer)
            self.kernels.fp8_to_tq3(
                k, v, src, dst, self.store.tq3[layer], self.store.rotations[layer].signs, self._layer_scales(layer)
            )

    def decode(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """TQ3 pages ``src`` -> hot pages ``dst`` (device page ids), every layer: a promotion."""
        src, dst = src.to(torch.int32), dst.to(torch.int32)
        for layer in range(self.store.shape.num_layers):
            k, v = self._caches(layer)
            self.kernels.tq3_to_fp8(
                self.store.tq3[layer], src, dst, k, v, self.store.rotations[layer].signs, self._layer_scales(layer)
            )


def kernel_conversions(store) -> KernelConversions | None:
    """The kernels for ``store`` where they apply, else None (the torch codec converts), saying why."""
    s = store.shape
    if store.device.type != "cuda":
        return None
    if unread := s.layout.kernel_unread:
        logger.info("Minima: conversions on the torch codec (the kernels do not write %s)", " or ".join(unread))
        return None
    if not store.is_fp8 or not is_power_of_two(s.head_dim):
        logger.info(
            "Minima: conversions on the torch codec (the kernels need FP8 hot pages and a power-of-two "
            "head_dim; hot dtype %s, head_dim %d)", s.hot_dtype, s.head_dim,
        )
        return None
    try:
        conversions = KernelConversions(store)
    except Exception as e:  # the gpu extra (tilelang) missing, or its build failing: the codec still converts
        logger.warning("Minima: conversions on the torch codec: the TileLang kernels are unavailable (%r)", e)
        return None
    logger.info("Minima: page conversions through the TileLang kernels (%d layers, %d-bit keys)", s.num_layers, s.layout.key_bits)
    return conversions
