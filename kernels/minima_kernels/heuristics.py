"""Every tuning rule of the decode in one place, pure Python (no tilelang, no GPU): the kernels'
builds (``tile_config``, ``fp8_tile_config``, ``fused_build_of``), the split counts
(``choose_num_splits``, ``choose_fp8_splits``, ``choose_mixed_splits`` and its few-slot part
``few_slot_tq3_splits``, a CUDA graph's ``graph_splits``) and the path choice of ``MinimaDecodeWrapper``
(``choose_path``: fused, two-launch with the TileLang FP8 decode, or with FlashInfer's). The constants
were measured on the H200 (docs/results/kernels.md), the split rule's waves on the H100 (device README,
stops 55-56); the SM count is an argument, read from the device by ``device_sm_count`` (132 on both).
test/kernels/test_heuristics.py checks them on CPU. The prefill's one rule, the TQ3 tile
(``prefill_tq3_kernel``, ``prefill_tile_pages``, ``prefill_scratch_bytes``), is here too: the pool's sizing reserves it.
"""

from dataclasses import dataclass

from sglang_minima.codec.layout import CHUNK_TOKENS, lane_words
from sglang_minima.codec.rotation import is_power_of_two

from .common import FP8_HEADS_PER_TILE, MAX_SPLITS, TWO_PAGE_STEP_MAX_HEAD_DIM
from .device_source import fp8_chunk_bytes

WARPS = 4  # the TQ3 decode's default build
STEP_CHUNKS = 2  # 16-token chunks per online-softmax step
FP8_STEP_CHUNKS = 1  # 16-token chunks per softmax step of the FP8 role (an FP8 chunk is 2.6x a TQ3 one)
NUM_SMS_H200 = 132  # the GPU the constants below were measured on (the H100 SXM's too)
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
TWO_PAGE_STEP_MIN_PAGES = 8  # pages per split from which a step takes 2 pages
# A CUDA graph's fused decode fixes its split counts at capture, before any page list is known: its
# FP8 role is sized for this many FP8 pages per request (the Recent tier, the sinks and a few Anchors
# at the launcher's defaults), the TQ3 role for the rest of the longest context. Any page counts
# decode right (each split takes its share of the request's pages from the lists at replay); only
# the balance between the two roles rests on this figure.
GRAPH_FP8_PAGES = 8
# The fused grid's TQ3 splits where the FP8 pages are few (the graph's GRAPH_FP8_PAGES, a gsp request's
# Recent tier), from sweeps of 1-32 of them with one FP8 split (H100, 4-bit keys, bench_graph_splits.py:
# Llama-class at 4-64 rows of 70, 512 and 2,040 pages, device README stop 55; 8-16 rows of 512 pages
# and SmolLM2 at 32-128 rows of 70 and 128 pages, stop 56).
# - WHOLE_WAVE_MIN_SLOTS resident CTA slots or more per (request, kv head): the share of one wave by
#   work keeps the FP8 split a slot; taking it for one more TQ3 split pushes an FP8 CTA past the wave,
#   where it delays a TQ3 CTA by its pages, so the extra split must shorten each TQ3 CTA by more (8
#   rows of 512 / 2,040 pages: 3 TQ3 splits 0.64 / 0.60x FlashInfer FP8's time, 4 splits 0.56 / 0.50x;
#   requests of 70 pages, where 4 save less than their FP8 split's 6 pages, 0.79 against 0.67x).
# - 2 or 3 slots (an eager step: where its FP8 pages leave the FP8 split one slot), and a graph below 4
#   slots whatever its share (an eager step below 2 keeps equal-work splits and ``fused_fits``): one FP8
#   split and TQ3 splits of one wave, or of TQ3_WAVES waves (halves up) where one wave would fill under
#   WAVE_FILL_MIN of the resident slots and the 1.5 waves' splits still hold TQ3_WAVES_MIN_PAGES pages
#   of head dim 128 (pages x head dim / 128) each: a split costs a fixed share (its key table, its
#   partial), more splits even out a badly filled wave. One wave: 9-11 Llama-class rows (3 slots a
#   pair, 82-100% of the GPU's: 3 TQ3 splits 0.52-0.57x, 5-6 splits 0.55-0.61x), 16 rows (2 slots,
#   97%: 2 splits 0.49-0.54x at 512-2,040 pages), SmolLM2's 48 rows (73%, but 1.5 waves' 4 splits
#   hold 8-15 such pages: 2 splits 0.52 / 0.66x, 4 splits 0.58 / 0.79x at 128 / 70 pages), 64 and 96
#   rows. 1.5 waves: 12 Llama-class rows (73%: 4 splits of 126 pages 0.45x, 2 splits 0.50x); 17 rows
#   (one split fills 52%; 3 splits 0.36-0.57x, one 0.48-0.62x). Before stop 55 a graph's equal-work
#   splits of the whole context cut 4.5K-token requests at 17+ rows into 255 TQ3 splits (a 138 ms
#   decode step, stop 54).
# Over the 49 graph cases of both sweeps these counts came within 1.023x of each case's best on
# geometric mean (worst 1.18x, 17 rows of 2,040 pages); stop 55's rule (1.5 waves below 4 slots) 1.043x
# (worst 1.20x, SmolLM2's 48 rows), stop 54's 1.21x over its 20 cases (worst 2.24x).
WHOLE_WAVE_MIN_SLOTS = 4
TQ3_WAVES = 1.5
WAVE_FILL_MIN = 0.8
TQ3_WAVES_MIN_PAGES = 64


def fp8_tile_config(page_size: int, head_dim: int = 128, pages_per_split: int = 1) -> dict[str, int]:
    """Compute threads per CTA (TileLang adds a producer warp group for the copies: a warp per 16
    tokens of the page, up to 4; GEMM 1 splits the page's tokens over the warps, at least 16 each),
    pipeline stages, and pages per step: 2 for splits of at least TWO_PAGE_STEP_MIN_PAGES pages at head
    dims up to 128, where the per-step latency sets the time (H200, the FP8 part alone: 9q/3kv/64
    batch 8 x 32K 33.0 -> 27.8 us, 32q/8kv/128 batch 1 x 128K 51.1 -> 44.1 us); shorter splits lose a
    half step at their end (9q/3kv/64 batch 1 x 32K, 3 pages per split: 10.6 -> 11.6 us)."""
    two = head_dim <= TWO_PAGE_STEP_MAX_HEAD_DIM and pages_per_split >= TWO_PAGE_STEP_MIN_PAGES
    return {"threads": 32 * max(1, min(4, page_size // 16)), "stages": 2, "pages_per_step": 2 if two else 1}


def device_sm_count(device) -> int:
    """The streaming multiprocessors of a CUDA device: what one wave of CTAs is counted in."""
    import torch  # here: the rules themselves need no torch

    return torch.cuda.get_device_properties(device).multi_processor_count


# Shared memory of an H200 SM and the most one CTA may take (sm_90: 228 KB and 227 KB, 1 KB of
# each SM's reserved per resident CTA)
SM_SHARED_BYTES = 228 * 1024
CTA_SHARED_BYTES = 227 * 1024
CTA_RESERVED_SHARED_BYTES = 1024
KEY_TABLE_BYTES = {3: 16 * 1024, 4: 32 * 1024}  # the key table (3-bit: 8 KB aligned inside 16 KB, device_source.py)


def decode_shared_bytes(head_dim: int, page_size: int, build: dict[str, int], key_bits: int = 3,
                        fp8_step_chunks: int = 0, group_size: int = 8, key_center: bool = False) -> int:
    """Shared memory of one CTA of the TQ3 split decode (``fp8_step_chunks`` 0) or of the fused
    decode, as split_decode.py allocates it: the warps' chunk rings (each the larger role's, or the
    output rows of the combine; with ``key_center`` a slot also holds its pages' mean keys), the
    metadata ring, the combine's statistics and the key table."""
    warps, stages, c = build["warps"], build.get("stages", 2), build["step_chunks"]
    chunk_words = 32 * (lane_words(head_dim) + lane_words(head_dim, key_bits))  # K and V codes
    mean_words = max(1, c // (page_size // CHUNK_TOKENS)) * head_dim // 2 if key_center else 0
    fp8_words = fp8_step_chunks * fp8_chunk_bytes(head_dim) // 4
    group = max(group_size, 1)  # the combine's output rows and statistics: the GQA group's heads
    warp_words = max(stages * (c * chunk_words + mean_words), stages * fp8_words, group * head_dim)
    meta = warps * stages * c * 3 * CHUNK_TOKENS * 2
    stats = 3 * warps * group * 4
    return 4 * warps * warp_words + meta + stats + KEY_TABLE_BYTES[key_bits]


def tile_config(group_size: int, page_size: int, head_dim: int = 128, batch: int | None = None,
                key_bits: int = 3, key_center: bool = False) -> dict[str, int]:
    """Build options for a (GQA group, page size, head dim, batch size): warps per CTA, resident CTAs
    per SM and chunks per softmax step, as measured best on the H200 (docs/results/kernels.md). The main
    loop is latency-bound, so warps in flight per SM is what matters: 16 for head dims up to 128 (8 x 2
    CTAs at ~128 registers; 4 x 4 at head dim 64, where 8-warp CTAs were slower), 12 at head dim 256
    (twice the accumulators: 168 registers, no spills; 16 warps spill). Steps of 2 chunks (4 at head
    dim 64, where per-step costs weigh most and registers allow: 120).

    A single request (``batch`` 1) is different: the TQ3 grid then has about one CTA per SM and runs
    beside the FP8 decode's, and a TQ3 build that takes every register of an SM makes the two kernels
    take turns. 8 warps per SM (head dims 256 and 64) leave registers for the FP8 decode's CTAs: 24q/4kv/256
    x 128K 81.8 -> 76.6 us, 9q/3kv/64 x 32K 26.0 -> 24.4 us; head dim 128 was slower with 8 (39.3 -> 43.3 us)."""
    # one tile shape serves every group and page size (16-token chunks, 8-head MMA tiles); both
    # count only in the shared memory of 4-bit keys' builds
    if head_dim >= 256:
        build = {"warps": 8 if batch == 1 else 12, "min_blocks": 1, "step_chunks": STEP_CHUNKS}
    elif head_dim >= 128:
        build = {"warps": 8, "min_blocks": 2, "step_chunks": STEP_CHUNKS}
    elif batch == 1:
        build = {"warps": 8, "min_blocks": 1, "step_chunks": 2 * STEP_CHUNKS}
    else:
        build = {"warps": 4, "min_blocks": 4, "step_chunks": 2 * STEP_CHUNKS}
    if key_center and head_dim >= 256:
        # the page's q'.m takes a few registers more: 12 warps' 168 spilled 8 bytes (3-bit keys)
        build["warps"] = min(build["warps"], 8)
    if key_bits == 3 and not key_center:
        return build
    # 4-bit keys (correct on the H200, not timed or tuned there yet): a 32 KB key table and a third more
    # key words per slot; page-centered keys: a mean key per page in each slot. The fused twin of the
    # build (the larger) must fit a CTA's shared memory, and min_blocks of them an SM.
    fused = fused_build_of(build, page_size)["fp8_step_chunks"]

    def shared() -> int:
        return decode_shared_bytes(head_dim, page_size, build, key_bits, fused, group_size or 8, key_center)

    while shared() > CTA_SHARED_BYTES and build["warps"] > 4:
        build["warps"] -= 4
    while build["min_blocks"] > 1 and build["min_blocks"] * (shared() + CTA_RESERVED_SHARED_BYTES) > SM_SHARED_BYTES:
        build["min_blocks"] -= 1
    return build


def tilelang_fp8_preferred(fp8_slots: int, head_dim: int) -> bool:
    """The two-launch path's "auto": the TileLang FP8 decode (rather than FlashInfer) for a batch of
    this many FP8 page slots (pages x page size, per kv head)."""
    return fp8_slots <= TILELANG_FP8_MAX_TOKENS.get(head_dim, min(TILELANG_FP8_MAX_TOKENS.values()))


def slots_per_pair(batch: int, num_kv_heads: int, build: dict[str, int], num_sms: int = NUM_SMS_H200) -> int:
    """Resident CTA slots of the build in one wave of the GPU, per (request, kv head) pair."""
    return build["min_blocks"] * num_sms // (batch * num_kv_heads)


def min_split_pages(build: dict[str, int], page_size: int) -> int:
    """The fewest pages a split takes: MIN_CHUNKS_PER_WARP chunks for each of the build's warps."""
    return max(1, -(-MIN_CHUNKS_PER_WARP * build["warps"] * CHUNK_TOKENS // page_size))


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
    return max(1, min(want, max_pages // min_split_pages(build, page_size)))


def choose_fp8_splits(batch: int, num_kv_heads: int, max_pages: int, num_sms: int = NUM_SMS_H200) -> int:
    """Splits per (request, kv head) of the TileLang FP8 decode: about FP8_CTAS_PER_SM CTAs per SM,
    with at least FP8_MIN_PAGES_PER_SPLIT pages per split."""
    want = FP8_CTAS_PER_SM * num_sms // (batch * num_kv_heads)
    return max(1, min(want, max_pages // FP8_MIN_PAGES_PER_SPLIT, MAX_SPLITS))


def few_slot_tq3_splits(
    batch: int, num_kv_heads: int, tq3_pages: int, head_dim: int, build: dict[str, int], num_sms: int = NUM_SMS_H200
) -> int:
    """TQ3 splits per (request, kv head) where the pairs have under WHOLE_WAVE_MIN_SLOTS resident
    slots each: one wave of them (at least one split), or TQ3_WAVES waves (halves up) where one wave
    would fill under WAVE_FILL_MIN of the slots and the 1.5 waves' splits still hold
    TQ3_WAVES_MIN_PAGES pages of head dim 128 each."""
    slots = build["min_blocks"] * num_sms / (batch * num_kv_heads)
    one = max(1, int(slots))
    waves = max(1, int(TQ3_WAVES * slots + 0.5))
    if one / slots < WAVE_FILL_MIN and tq3_pages * head_dim >= TQ3_WAVES_MIN_PAGES * 128 * waves:
        return waves
    return one


def one_wave_share(slots: int, tq3_work: float, fp8_work: float) -> tuple[int, int]:
    """(TQ3 splits, FP8 splits) of one wave of ``slots`` resident CTA slots (2 or more) per (request,
    kv head), shared in proportion to each format's work, each format at least a slot."""
    tq3 = min(slots - 1, max(1, round(slots * tq3_work / (tq3_work + fp8_work))))
    return tq3, slots - tq3


def choose_mixed_splits(
    batch: int,
    num_kv_heads: int,
    max_tq3_pages: int,
    max_fp8_pages: int,
    page_size: int,
    build: dict[str, int],
    fp8_weight: float = FUSED_FP8_CHUNK_WEIGHT,
    num_sms: int = NUM_SMS_H200,
    *,
    head_dim: int,
) -> tuple[int, int]:
    """(TQ3 splits, FP8 splits) per (request, kv head) of ``mixed_decode_kernel``. With
    WHOLE_WAVE_MIN_SLOTS resident slots or more per (request, kv head) pair, the CTAs of one wave,
    shared in proportion to each format's work (an FP8 chunk weighs ``fp8_weight`` TQ3 chunks); the
    whole wave goes to the TQ3 pages where one more TQ3 split shortens each by more than the FP8
    split's work. With 2 or 3 slots, where that share leaves one FP8 split, ``few_slot_tq3_splits``
    (one wave, or 1.5 where one fills the GPU badly and the CTAs stay long). With fewer, the grid
    takes several waves anyway: splits of about equal work (one FP8 split, the TQ3 pages in as many),
    so that no long TQ3 CTA starts in a late wave. Each split has at least MIN_CHUNKS_PER_WARP chunks
    per warp."""
    slots = slots_per_pair(batch, num_kv_heads, build, num_sms)
    tq3_work, fp8_work = max_tq3_pages, fp8_weight * max_fp8_pages
    if slots >= 2:
        tq3, fp8 = one_wave_share(slots, tq3_work, fp8_work)
        if slots >= WHOLE_WAVE_MIN_SLOTS:
            if tq3_work / (slots - 1) - tq3_work / slots > fp8_work:  # then the share above gave (slots - 1, 1)
                tq3 = slots
        elif fp8 == 1:  # 2 slots, or 3 with at least as much TQ3 work as FP8
            tq3 = few_slot_tq3_splits(batch, num_kv_heads, max_tq3_pages, head_dim, build, num_sms)
    else:
        tq3, fp8 = max(1, round(tq3_work / fp8_work)), 1
    min_pages = min_split_pages(build, page_size)
    return max(1, min(tq3, max_tq3_pages // min_pages)), max(1, min(fp8, max_fp8_pages // min_pages))


def fused_fits(
    batch: int,
    num_kv_heads: int,
    max_tq3_pages: int,
    max_fp8_pages: int,
    page_size: int,
    build: dict[str, int],
    num_sms: int = NUM_SMS_H200,
    *,
    head_dim: int,
) -> bool:
    """Whether "auto" takes the fused decode for this batch: unless its grid takes several waves
    (fewer than 2 resident slots per (request, kv head)) of TQ3 splits under FUSED_MULTI_WAVE_MIN_PAGES."""
    if slots_per_pair(batch, num_kv_heads, build, num_sms) >= 2:
        return True
    tq3_splits, _ = choose_mixed_splits(
        batch, num_kv_heads, max_tq3_pages, max_fp8_pages, page_size, build, num_sms=num_sms, head_dim=head_dim
    )
    return max_tq3_pages >= FUSED_MULTI_WAVE_MIN_PAGES * tq3_splits


def graph_splits(
    batch: int,
    num_kv_heads: int,
    max_pages: int,
    page_size: int,
    build: dict[str, int],
    num_sms: int = NUM_SMS_H200,
    *,
    head_dim: int,
) -> tuple[int, int]:
    """(TQ3 splits, FP8 splits) per (request, kv head) of a CUDA graph's fused decode, from what is
    fixed at capture only: the batch size and ``max_pages``, the longest context in pages (the
    model's). ``choose_mixed_splits``'s for requests of ``max_pages`` pages, GRAPH_FP8_PAGES of them
    FP8; below WHOLE_WAVE_MIN_SLOTS resident slots a pair, one FP8 split and ``few_slot_tq3_splits``
    whatever the share (below 2 slots equal-work splits of the whole context would leave most CTAs
    without a page). Each split holds at least ``min_split_pages`` pages."""
    fp8_pages = min(GRAPH_FP8_PAGES, max_pages)
    tq3_pages = max(1, max_pages - fp8_pages)
    if slots_per_pair(batch, num_kv_heads, build, num_sms) < WHOLE_WAVE_MIN_SLOTS:
        few = few_slot_tq3_splits(batch, num_kv_heads, tq3_pages, head_dim, build, num_sms)
        tq3, fp8 = max(1, min(few, tq3_pages // min_split_pages(build, page_size))), 1
    else:
        tq3, fp8 = choose_mixed_splits(
            batch, num_kv_heads, tq3_pages, max(1, fp8_pages), page_size, build, num_sms=num_sms, head_dim=head_dim
        )
    return min(tq3, MAX_SPLITS), min(fp8, MAX_SPLITS)


def fused_build_of(tq3_build: dict[str, int], page_size: int) -> dict[str, int]:
    """``mixed_decode_kernel``'s build: the TQ3 decode's, its FP8 role taking steps of FP8_STEP_CHUNKS
    chunks (at most a page)."""
    return {**tq3_build, "fp8_step_chunks": min(FP8_STEP_CHUNKS, page_size // CHUNK_TOKENS)}


def tilelang_fp8_applies(group_size: int, fp8_page_size: int) -> bool:
    """Whether the TileLang FP8 decode takes this GQA group and FP8 page size."""
    return group_size <= FP8_HEADS_PER_TILE and fp8_page_size in TILELANG_FP8_PAGE_SIZES


def compile_builds(
    fp8_kernel: str,
    group_size: int,
    page_size: int,
    head_dim: int,
    fp8_page_size: int,
    tq3_config: dict[str, int] | None = None,
    fp8_config: dict[str, int] | None = None,
    key_bits: int = 3,
    key_center: bool = False,
) -> list[tuple[str, dict[str, int]]]:
    """Every TileLang build that ``MinimaDecodeWrapper.plan`` may pick under ``fp8_kernel``, as
    (kernel, build) with kernel "tq3" (``tq3_decode_kernel``), "mixed" (``mixed_decode_kernel``) or
    "fp8" (``fp8_decode_kernel``), each once: ``tile_config``'s two TQ3 builds (one request, batches)
    and their fused twins where the fused decode applies, ``fp8_tile_config``'s one- and two-page
    steps where the TileLang FP8 decode does. ``*_config``: the wrapper's overrides."""
    builds: list[tuple[str, dict[str, int]]] = []
    for batch in (1, None):
        tq3_build = {**tile_config(group_size, page_size, head_dim, batch, key_bits, key_center), **(tq3_config or {})}
        builds.append(("tq3", tq3_build))
        if fp8_kernel in ("auto", "fused") and fp8_page_size == page_size:
            builds.append(("mixed", fused_build_of(tq3_build, page_size)))
    if fp8_kernel in ("auto", "tilelang") and tilelang_fp8_applies(group_size, fp8_page_size):
        for pages_per_split in (1, TWO_PAGE_STEP_MIN_PAGES):
            builds.append(("fp8", {**fp8_tile_config(fp8_page_size, head_dim, pages_per_split), **(fp8_config or {})}))
    return [b for i, b in enumerate(builds) if b not in builds[:i]]


@dataclass(frozen=True)
class DecodePath:
    """How one batch is decoded: the fused grid, or the two-launch path with the TileLang FP8 decode
    or (neither flag) FlashInfer's over the FP8 pages; split counts per (request, kv head), 0 where a
    part is absent (FlashInfer plans its own splits)."""

    fused: bool
    tilelang_fp8: bool
    tq3_splits: int
    fp8_splits: int

    @property
    def fp8_parts(self) -> bool:
        """The FP8 part gives split partials (the TileLang FP8 decode's or the fused grid's)."""
        return self.fused or self.tilelang_fp8


def choose_path(
    fp8_kernel: str,
    *,
    batch: int,
    num_kv_heads: int,
    group_size: int,
    head_dim: int,
    page_size: int,
    fp8_page_size: int,
    num_fp8_pages: int,
    max_fp8_pages: int,
    max_tq3_pages: int,
    tq3_build: dict[str, int] | None,
    num_splits: int | None = None,
    num_fp8_splits: int | None = None,
    num_sms: int = NUM_SMS_H200,
) -> DecodePath:
    """``MinimaDecodeWrapper.plan``'s choice for a batch with ``num_fp8_pages`` FP8 pages in all (the
    longest request: ``max_fp8_pages`` / ``max_tq3_pages``). ``fp8_kernel`` "auto": the fused decode
    where it applies (FP8 pages of the TQ3 page size) unless its grid would take several waves of
    short TQ3 splits (``fused_fits``); else the TileLang FP8 decode or FlashInfer by the batch's FP8
    page slots (``tilelang_fp8_preferred``). ``num_splits`` / ``num_fp8_splits`` override the split
    counts. Raises ValueError for a choice that does not apply or splits the combine cannot take."""
    if fp8_kernel not in FP8_KERNELS:
        raise ValueError(f"fp8_kernel={fp8_kernel!r}: one of {FP8_KERNELS}")
    tilelang_ok = tilelang_fp8_applies(group_size, fp8_page_size)
    if fp8_kernel == "fused" and fp8_page_size != page_size:
        raise ValueError(f"fp8_kernel='fused' takes FP8 pages of the TQ3 page size {page_size}, got {fp8_page_size}")
    if fp8_kernel == "tilelang" and not tilelang_ok:
        raise ValueError(
            f"fp8_kernel='tilelang' takes GQA groups of at most {FP8_HEADS_PER_TILE} query heads and FP8 pages of "
            f"{TILELANG_FP8_PAGE_SIZES} tokens, got group {group_size}, page {fp8_page_size}"
        )
    has_fp8, has_tq3 = num_fp8_pages > 0, tq3_build is not None
    use_fused = has_fp8 and has_tq3 and (
        fp8_kernel == "fused"
        or (
            fp8_kernel == "auto"
            and fp8_page_size == page_size
            and fused_fits(
                batch, num_kv_heads, max_tq3_pages, max_fp8_pages, page_size, tq3_build, num_sms, head_dim=head_dim
            )
        )
    )
    use_tilelang = (
        has_fp8
        and has_tq3
        and not use_fused
        and tilelang_ok
        and (fp8_kernel == "tilelang" or (fp8_kernel == "auto" and tilelang_fp8_preferred(num_fp8_pages * fp8_page_size, head_dim)))
    )
    if use_fused:
        tq3_splits, fp8_splits = choose_mixed_splits(
            batch, num_kv_heads, max_tq3_pages, max_fp8_pages, page_size, tq3_build, num_sms=num_sms, head_dim=head_dim
        )
        tq3_splits, fp8_splits = num_splits or tq3_splits, num_fp8_splits or fp8_splits
    else:
        fp8_splits = (num_fp8_splits or choose_fp8_splits(batch, num_kv_heads, max_fp8_pages, num_sms)) if use_tilelang else 0
        tq3_splits = (
            (num_splits or choose_num_splits(batch, num_kv_heads, max_tq3_pages, page_size, head_dim, num_sms, tq3_build))
            if has_tq3
            else 0
        )
    path = DecodePath(use_fused, use_tilelang, tq3_splits, fp8_splits)
    for name, splits, used in (("num_fp8_splits", fp8_splits, path.fp8_parts), ("num_splits", tq3_splits, has_tq3)):
        if used and not 1 <= splits <= MAX_SPLITS:
            raise ValueError(f"{name}={splits}: the split combine takes 1 to {MAX_SPLITS}")
    return path


PREFILL_TILE_TOKENS = 16384
"""TQ3 tokens the prefill decodes at once on the kernel path: K and V in bf16, 4 bytes per element
(16,384 tokens of 8 heads of 128: 64 MiB)."""
PREFILL_TORCH_TILE_TOKENS = 4096
"""The torch codec's tile (head dims without the kernels' rotation): K and V in fp32 plus their
bf16 copies, 12 bytes per element."""


def prefill_tq3_kernel(device_type: str, head_dim: int) -> bool:
    """Whether the prefill decodes its TQ3 tiles with the kernel: on CUDA, for head dims with the
    kernels' Hadamard rotation (a power of two); otherwise with the torch codec."""
    return device_type == "cuda" and is_power_of_two(head_dim)


def prefill_tile_pages(page_size: int, *, kernel: bool, tile_tokens: int | None = None) -> int:
    """Pages of one TQ3 tile of ``MinimaPrefillWrapper`` (at least one)."""
    default = PREFILL_TILE_TOKENS if kernel else PREFILL_TORCH_TILE_TOKENS
    return max(1, (tile_tokens or default) // page_size)


def prefill_scratch_bytes(
    num_kv_heads: int, head_dim: int, page_size: int, *, kernel: bool, tile_tokens: int | None = None
) -> int:
    """The most one layer's TQ3 prefix holds decoded at once (what the prefill meters as scratch):
    a full tile's K and V. Layers run one after another, so this bounds a forward's prefill scratch;
    the pool's sizing charges it before SGLang turns the rest into tokens."""
    tokens = prefill_tile_pages(page_size, kernel=kernel, tile_tokens=tile_tokens) * page_size
    return num_kv_heads * tokens * head_dim * (4 if kernel else 12)

