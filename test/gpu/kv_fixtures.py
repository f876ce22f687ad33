"""Random mixed FP8 / TQ3 paged KV batches for the GPU tests and the kernel benchmark.

Keys and values are "real-like": Gaussian with a few large outlier channels (the channels that make
an unrotated 3-bit code collapse). FP8 pages are SGLang's layout [num_pages, P, H, D] (uint8 e4m3),
TQ3 pages are encoded by the torch codec, so the kernels are checked against the reference format.
"""

from dataclasses import dataclass

import torch
from sglang_minima.codec import LayerRotation, TQ3PageLayout, encode_pages, fp8_dequantize, fp8_quantize
from sglang_minima.codec.codebook import key_codebook
from sglang_minima.ops import HotPagedKV, Tq3PagedKV, mixed_paged_attention


def real_like(
    shape: tuple[int, ...], generator: torch.Generator, device: str, outlier_channels: int = 3
) -> torch.Tensor:
    """Gaussian [..., D] with ``outlier_channels`` channels scaled up 8-20x (bf16)."""
    x = torch.randn(shape, generator=generator, device=device)
    d = shape[-1]
    idx = torch.randperm(d, generator=generator, device=device)[:outlier_channels]
    gain = 8 + 12 * torch.rand(outlier_channels, generator=generator, device=device)
    x[..., idx] *= gain
    return x.to(torch.bfloat16)


@dataclass
class MixedBatch:
    q: torch.Tensor  # [B, Hq, D] bf16
    k_fp8: torch.Tensor  # [n_fp8, P, H, D] uint8
    v_fp8: torch.Tensor
    tq3_pages: torch.Tensor  # [n_tq3, page_bytes] uint8
    fp8_indptr: torch.Tensor  # host int32
    fp8_page_ids: torch.Tensor
    fp8_last_page_len: torch.Tensor
    tq3_indptr: torch.Tensor
    tq3_page_ids: torch.Tensor
    rotation: LayerRotation
    layout: TQ3PageLayout
    k_scale: float
    v_scale: float

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    def plan_args(self) -> tuple[torch.Tensor, ...]:
        return self.fp8_indptr, self.fp8_page_ids, self.fp8_last_page_len, self.tq3_indptr, self.tq3_page_ids

    def kv_bytes(self) -> int:
        """Bytes of KV the decode must read (FP8 tokens in use + whole TQ3 pages)."""
        h, p, d = self.layout.num_kv_heads, self.layout.page_size, self.layout.head_dim
        n_fp8 = int(self.fp8_indptr[-1])
        fp8_tokens = n_fp8 * p - int((p - self.fp8_last_page_len)[self.fp8_indptr[1:] > self.fp8_indptr[:-1]].sum())
        return fp8_tokens * h * 2 * d + int(self.tq3_indptr[-1]) * self.layout.page_bytes

    def reference(self, sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch reference op per request: (out fp32 [B, Hq, D], lse [B, Hq] base 2)."""
        h, p, d = self.layout.num_kv_heads, self.layout.page_size, self.layout.head_dim
        k_slots = self.k_fp8.view(-1, h, d)
        v_slots = self.v_fp8.view(-1, h, d)
        book = key_codebook(d, self.layout.key_bits)
        outs, lses = [], []
        for b in range(self.batch):
            pages = self.fp8_page_ids[self.fp8_indptr[b] : self.fp8_indptr[b + 1]].long()
            hot = None
            if pages.numel():
                slots = (pages.view(-1, 1) * p + torch.arange(p)).reshape(-1)
                slots = slots[: slots.numel() - (p - int(self.fp8_last_page_len[b]))]
                hot = HotPagedKV(k_slots, v_slots, slots.to(k_slots.device), k_scale=self.k_scale, v_scale=self.v_scale)
            tq3_ids = self.tq3_page_ids[self.tq3_indptr[b] : self.tq3_indptr[b + 1]].long().to(k_slots.device)
            tq3 = Tq3PagedKV(self.tq3_pages, tq3_ids, self.layout, book) if tq3_ids.numel() else None
            out, lse = mixed_paged_attention(self.q[b : b + 1].float(), hot, tq3, self.rotation, sm_scale)
            outs.append(out)
            lses.append(lse)
        return torch.cat(outs), torch.cat(lses)


def fp8_pages(
    num_pages: int, page_size: int, heads: int, dim: int, scale: float, gen: torch.Generator, device: str
) -> torch.Tensor:
    return fp8_quantize(real_like((num_pages, page_size, heads, dim), gen, device), scale)


def tq3_pages_from(
    k: torch.Tensor, v: torch.Tensor, layout: TQ3PageLayout, rotation: LayerRotation, k_scale: float, v_scale: float
) -> torch.Tensor:
    """TQ3P pages encoded by the torch codec from FP8 pages [N, P, H, D] (uint8)."""
    return encode_pages(
        k.transpose(1, 2),
        v.transpose(1, 2),
        layout,
        rotation,
        key_codebook(layout.head_dim, layout.key_bits),
        k_scale=k_scale,
        v_scale=v_scale,
    )


def make_batch(
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    fp8_pages_per_req: list[int],
    tq3_pages_per_req: list[int],
    last_page_len: list[int],
    *,
    seed: int = 0,
    device: str = "cuda",
    spare_pages: int = 3,
    layer_id: int = 0,
    unused_slot_byte: int = 0x7E,
    key_bits: int = 3,
    key_center: bool = False,
    key_offset: float = 0.0,
) -> MixedBatch:
    """A batch whose requests own ``fp8_pages_per_req[b]`` FP8 pages (the last filled to
    ``last_page_len[b]``) and ``tq3_pages_per_req[b]`` TQ3 pages, scattered over pools with spare pages.
    The slots past each request's last token hold ``unused_slot_byte`` (default e4m3 448, the largest
    finite value; 0x7F is NaN). ``key_bits``: the TQ3 pages' key code width (3, or 4); ``key_center``:
    page-centered TQ3 keys; ``key_offset``: each TQ3 page's keys shifted by its own random vector per
    head of that standard deviation (real keys' large shared component, which centering takes out)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    k_scale, v_scale = 0.5, 0.25
    layout = TQ3PageLayout(num_kv_heads, page_size, head_dim, key_bits, key_center)
    rotation = LayerRotation(num_kv_heads, head_dim, layer_id=layer_id, seed=seed, device=device)

    n_fp8 = sum(fp8_pages_per_req) + spare_pages
    k_fp8 = fp8_pages(n_fp8, page_size, num_kv_heads, head_dim, k_scale, gen, device)
    v_fp8 = fp8_pages(n_fp8, page_size, num_kv_heads, head_dim, v_scale, gen, device)
    n_tq3 = sum(tq3_pages_per_req) + spare_pages
    src_k = fp8_pages(n_tq3, page_size, num_kv_heads, head_dim, k_scale, gen, device)
    if key_offset:
        shift = key_offset * torch.randn(n_tq3, 1, num_kv_heads, head_dim, generator=gen, device=device)
        src_k = fp8_quantize((fp8_dequantize(src_k, k_scale) + shift).to(torch.bfloat16), k_scale)
    src_v = fp8_pages(n_tq3, page_size, num_kv_heads, head_dim, v_scale, gen, device)
    tq3 = tq3_pages_from(src_k, src_v, layout, rotation, k_scale, v_scale)

    cpu = torch.Generator().manual_seed(seed)
    fp8_perm = torch.randperm(n_fp8, generator=cpu).to(torch.int32)
    tq3_perm = torch.randperm(n_tq3, generator=cpu).to(torch.int32)
    fp8_indptr = torch.tensor([0] + fp8_pages_per_req, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    tq3_indptr = torch.tensor([0] + tq3_pages_per_req, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    q = torch.randn(len(fp8_pages_per_req), num_qo_heads, head_dim, generator=gen, device=device).to(torch.bfloat16)
    # a kernel that let the slots past a request's last token into the softmax would be far off
    for b, n in enumerate(last_page_len):
        if fp8_pages_per_req[b]:
            last = int(fp8_perm[int(fp8_indptr[b + 1]) - 1])
            k_fp8[last, n:] = unused_slot_byte
            v_fp8[last, n:] = unused_slot_byte
    return MixedBatch(
        q=q,
        k_fp8=k_fp8,
        v_fp8=v_fp8,
        tq3_pages=tq3,
        fp8_indptr=fp8_indptr,
        fp8_page_ids=fp8_perm[: int(fp8_indptr[-1])].clone(),
        fp8_last_page_len=torch.tensor(last_page_len, dtype=torch.int32),
        tq3_indptr=tq3_indptr,
        tq3_page_ids=tq3_perm[: int(tq3_indptr[-1])].clone(),
        rotation=rotation,
        layout=layout,
        k_scale=k_scale,
        v_scale=v_scale,
    )


def batch_from_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    page_size: int,
    tq3_pages: int,
    *,
    layer_id: int,
    seed: int = 0,
    device: str = "cuda",
    spare_pages: int = 3,
) -> MixedBatch:
    """One request over real K/V [N, H, D] (N a multiple of page_size) with query q [Hq, D]: FP8 with
    per-layer amax/448 scales, as an FP8 KV cache stores it; the first ``tq3_pages`` pages converted
    to TQ3 from their FP8 bytes (Stale), the rest kept FP8 (Recent); pages scattered over pools with
    spare pages."""
    n, h, d = k.shape
    if n % page_size:
        raise ValueError(f"{n} tokens are not whole pages of {page_size}")
    k, v = k.to(device), v.to(device)
    k_scale, v_scale = float(k.abs().max()) / 448, float(v.abs().max()) / 448
    k_pages = fp8_quantize(k.view(-1, page_size, h, d).float(), k_scale)
    v_pages = fp8_quantize(v.view(-1, page_size, h, d).float(), v_scale)
    layout = TQ3PageLayout(h, page_size, d)
    rotation = LayerRotation(h, d, layer_id=layer_id, seed=seed, device=device)
    n_pages = n // page_size
    n_fp8 = n_pages - tq3_pages

    # spare pool pages hold other pages of the same layer (in range for its FP8 scales), rolled
    def filler(pages: torch.Tensor, count: int) -> torch.Tensor:
        reps = -(-count // pages.shape[0])
        return pages.roll(1, 0).repeat(reps, 1, 1, 1)[:count].clone()

    pool_k, pool_v = filler(k_pages, n_fp8 + spare_pages), filler(v_pages, n_fp8 + spare_pages)
    tq3_pool = tq3_pages_from(
        filler(k_pages, tq3_pages + spare_pages), filler(v_pages, tq3_pages + spare_pages), layout, rotation, k_scale, v_scale
    )
    cpu = torch.Generator().manual_seed(seed)
    fp8_ids = torch.randperm(n_fp8 + spare_pages, generator=cpu)[:n_fp8].to(torch.int32)
    tq3_ids = torch.randperm(tq3_pages + spare_pages, generator=cpu)[:tq3_pages].to(torch.int32)
    pool_k[fp8_ids.long()] = k_pages[tq3_pages:]
    pool_v[fp8_ids.long()] = v_pages[tq3_pages:]
    tq3_pool[tq3_ids.long().to(device)] = tq3_pages_from(
        k_pages[:tq3_pages], v_pages[:tq3_pages], layout, rotation, k_scale, v_scale
    )
    return MixedBatch(
        q=q.to(device, torch.bfloat16).unsqueeze(0),
        k_fp8=pool_k,
        v_fp8=pool_v,
        tq3_pages=tq3_pool,
        fp8_indptr=torch.tensor([0, n_fp8], dtype=torch.int32),
        fp8_page_ids=fp8_ids,
        fp8_last_page_len=torch.tensor([page_size], dtype=torch.int32),
        tq3_indptr=torch.tensor([0, tq3_pages], dtype=torch.int32),
        tq3_page_ids=tq3_ids,
        rotation=rotation,
        layout=layout,
        k_scale=k_scale,
        v_scale=v_scale,
    )
