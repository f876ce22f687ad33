"""The split-KV decode body of ``tq3_decode_kernel`` (tq3_decode.py) and ``mixed_decode_kernel``
(mixed_decode.py): TQ3 paged split-KV decode attention in TileLang.

One CTA = (split, kv head, request), ``warps`` warps (``heuristics.tile_config``). The CTA's share of the
request's TQ3 pages (CSR: ``page_indptr`` / ``page_ids``) is cut into 16-token chunks (one MMA tile),
and the warps take steps of ``step_chunks`` chunks round-robin, each warp with its own online-softmax
state, so the main loop has no CTA barrier. A step runs the key GEMM of each of its chunks, then one
softmax update over all of them (one max reduction, one rescale), then the value GEMMs: the per-step
costs (shuffles, exponentials of the running max, loop and copy bookkeeping) are shared by 2-4 chunks.
Pages store their codes in MMA order (codec/layout.py): a warp copies a step's code words with
cp.async (adjacent pieces, coalesced) into its ring of ``stages`` slots, each lane reads its own
stream back into registers and turns each 96-bit triple into 16 fp16x2 tensor-core operands: values
with bit operations, keys with one table load each. No decoded tile in shared memory. The copy
addresses are loop invariants plus one page pointer per step: with warps x step_chunks a multiple of
the chunks per page, a warp's steps start at the same chunk of their pages.

Both GEMMs put the query heads of the GQA group on the MMA's N = 8 side (swap AB), so a group of up
to 8 heads costs one n8 tile instead of a padded m16 one, and each decoded tile serves the group:

    scores^T = K_chunk [16 tok x D] . q'^T [D x 8 heads]     (keys: Lloyd-Max centroids, fp16)
    out'^T  += V_chunk^T [D x 16 tok] . (p * v_scale)^T     (values: the raw codes 0..7, exact)
    out'     = (out'^T)^T + sum_t p_t v_zero_t               (one rank-1 zero term per head)

A key pair (two 3-bit codes, one 6-bit field of its word, layout.WORD_BITS) is the index of a
64-entry table of fp16x2 centroid pairs in shared memory, built once per CTA from the fp16 codebook.
The table has one column per lane (entry e of lane l at byte 128 e + 4 l) so a warp's 32 lookups
never share a bank, and the field's bits are the byte offset after one shift and one lop3 that
masks it and ORs in the lane. This replaced an fp16 polynomial of c - 3.5 (six FMA-pipe ops per pair,
~75% of the decode's issue slots). The score scale (norm correction * sm_scale * log2 e) is applied
per token after the GEMM. The probabilities move from the scores' accumulator layout to the B
operand of the value GEMM with ``movmatrix``. Softmax is base 2 (``ex2.approx.ftz``); each split
writes its partial output (rotated space, fp32) and LSE (base 2); a split with no page writes out =
0, lse = -inf. The warps' output rows meet in their own parts of the ring (free after the loop), and
``rotation_merge.tq3_merge_splits`` (or the mixed decode's epilogue) combines the splits.

``mixed_decode_kernel`` (mixed_decode.py) is the same split body with a second role: CTAs past the
TQ3 splits decode FP8 pages (SGLang's e4m3 pool) with the same ring, softmax and combine, their
chunks converted from e4m3 into the MMA operands in registers (``device_source.fp8_device_source``),
so one grid covers both formats. The CUDA helpers both roles call are written in device_source.py.

Page-centered keys (``key_center``): a key is ``s * centroid + m``, m the page's fp16 mean key of the
head (the page's ``k_mean``). Its score term q'.m is one per page and query head: the mean's D/2 words
ride in each ring slot behind the step's chunks (one 16-byte cp.async per lane of D/8), and one more
key GEMM per page of the step, with m in every row of the A operand, leaves q'.m in every lane's
accumulator for its heads 2t, 2t + 1; it is added to the step's scaled scores (D/16 MMAs a page
against the chunks' 4 D/16).
"""

from types import SimpleNamespace

import tilelang.language as T
from sglang_minima.codec.layout import CHUNK_TOKENS, LANES, PAIRS_PER_TRIPLE, TRIPLE_WORDS, TQ3PageLayout

from .common import LOG2E, TQ3_HEADS_PER_TILE as HEADS_PER_TILE, key_bits_of
from .device_source import fp8_chunk_bytes, fp8_device_source, tq3_device_source

TQ3_BUILD_OPTIONS = ("min_blocks", "warps", "stages", "step_chunks", "shift_by_imad")  # tq3_decode_kernel's


def split_decode(
    num_kv_heads: int,
    group_size: int,
    head_dim: int,
    page_size: int,
    sm_scale: float,
    centroids: tuple[float, ...],
    *,
    min_blocks: int,
    warps: int,
    stages: int,
    step_chunks: int,
    shift_by_imad: bool,
    fp8_step_chunks: int = 0,
    q_dtype: str = "bfloat16",
    key_center: bool = False,
):
    """The prim_func of ``tq3_decode_kernel`` (``fp8_step_chunks`` 0) or of ``mixed_decode_kernel``.
    The key codebook's size is the key code width: 8 centroids, 3-bit keys; 16, 4-bit keys (their lane
    streams are 4 pieces instead of 3, one byte per pair: ``device_source._key4_table_source``).
    ``key_center``: the pages' keys are page-centered (their ``k_mean`` read and q'.m added)."""
    key_bits = key_bits_of(centroids)
    k4 = key_bits == 4
    layout = TQ3PageLayout(num_kv_heads, page_size, head_dim, key_bits, key_center)
    H, G, D, P = num_kv_heads, group_size, head_dim, page_size
    C = step_chunks
    C8 = fp8_step_chunks
    NB = -(-G // HEADS_PER_TILE)  # head tiles of 8
    heads = H * G
    lane_words = layout.v_lane_words  # 3, 6, 12 (and the keys', 3-bit)
    k_lane_words = layout.k_lane_words  # 4-bit keys: 4, 8, 16
    triples = lane_words // TRIPLE_WORDS
    vec = lane_words // TRIPLE_WORDS  # a lane's stream is copied and read as 3 pieces of D/64 words
    blocks = D // 16
    chunks_per_page = P // CHUNK_TOKENS
    page_words = layout.page_bytes // 4
    k_pieces = k_lane_words // vec  # a key lane stream's pieces: 3, or 4 with 4-bit keys
    k_head_words, v_head_words = layout.k_head_code_bytes // 4, layout.v_head_code_bytes // 4
    chunk_words = LANES * lane_words  # a chunk's value words (and key words, 3-bit)
    k_chunk_words = LANES * k_lane_words
    kv_chunk_words = k_chunk_words + chunk_words
    # The chunks of a step share a page unless pages are shorter than a step, which then spans
    # step_pages whole pages; a split's last step may then miss chunks, masked out of the softmax.
    step_pages = max(1, C // chunks_per_page)
    mean_words = D // 2 if key_center else 0  # a page's mean key of one head (fp16 pairs)
    # a ring slot: the step's chunks, each K codes then V codes, then (key_center) its pages' mean keys
    slot_words = C * kv_chunk_words + step_pages * mean_words
    fp8_chunk_words = fp8_chunk_bytes(D) // 4
    fp8_slot_words = C8 * fp8_chunk_words
    chunk_meta = 3 * CHUNK_TOKENS  # a chunk's k_norm, v_scale, v_zero (halves) in the metadata ring
    # a warp's part of the ring; after the main loop it holds the warp's output rows for the combine
    warp_words = max(stages * slot_words, stages * fp8_slot_words, G * D)
    k_base, v_base = layout.k_codes_offset // 4, layout.v_codes_offset // 4
    kn_base, vs_base, vz_base = layout.k_norm_offset // 2, layout.v_scale_offset // 2, layout.v_zero_offset // 2
    km_base = layout.k_mean_offset // 4 if key_center else 0  # 16-byte aligned: one cp.async per lane of D/8
    assert not key_center or layout.k_mean_offset % 16 == 0
    scale = sm_scale * LOG2E
    source = tq3_device_source(centroids, shift_by_imad)
    if C8:
        source += fp8_device_source(H, D, P)
    if stages < 2:
        raise ValueError(f"stages={stages}: the chunk ring needs at least 2 slots")
    if C not in (1, 2, 4):
        raise ValueError(f"step_chunks={C}: 1, 2 or 4 16-token chunks per softmax step")
    if C8 and (C8 not in (1, 2, 4) or chunks_per_page % C8 or (warps * C8) % chunks_per_page):
        raise ValueError(
            f"fp8_step_chunks={C8}: 1, 2 or 4, dividing the {chunks_per_page} chunks per page, with warps={warps} x it a multiple of them"
        )
    if C8 and q_dtype not in ("bfloat16", "float16"):
        raise ValueError(f"q_dtype={q_dtype!r}: bfloat16 or float16")
    ragged = step_pages > 1
    # With warps * C a multiple of the chunks per page, a warp's steps start at the same chunk of
    # their pages and the page index advances by a constant: the main loop does no address division.
    if (warps * C) % chunks_per_page:
        raise ValueError(f"warps={warps} x step_chunks={C} must be a multiple of the {chunks_per_page} chunks per page")
    if k4:
        copy_chunk = f"minima::copy_chunk_kv<{4 * vec}, {k_pieces}, {4 * k_chunk_words}>"
    else:
        assert k_head_words == v_head_words and k_chunk_words == chunk_words  # values = keys + v_base - k_base
        copy_chunk = f"minima::copy_chunk<{4 * vec}, {4 * (v_base - k_base)}, {4 * chunk_words}>"
    neg_inf = -T.infinity(T.float32)
    CM = max(C, C8)  # per-step buffers hold the larger role's chunks

    def query_word(fp8: bool, q_words, bid, head, kb, t, j):
        """B operand j of k-block kb of this lane (query head ``head``) as fp16x2: the TQ3 role's
        rotated fp16 queries in the natural dim order, the FP8 role's in the key GEMM's
        (``device_source.fp8_device_source``), from ``q_dtype`` pairs."""
        if not fp8:
            return T.Cast(T.uint32, q_words[bid, head, kb * 8 + t + 4 * j])
        word = T.Cast(T.uint32, q_words[bid, head, 16 * (kb // 2) + 4 * t + 2 * (kb % 2) + j])
        return T.call_extern(T.uint32, "minima::bf16x2_to_half2", word) if q_dtype == "bfloat16" else word

    @T.macro
    def split_body(fp8: bool, sid, hk, bid, tid, q_words, pool, page_indptr, page_ids, fp8_last_len, score_scale, out_partial, lse_partial, L):
        """One CTA's split: the TQ3 role (``fp8`` False: TQ3 pages of the rotated query) or the FP8
        role (FP8 pages of the query as given); ``pool`` is the TQ3 pool's words or (K, V) FP8 pools.
        The split count is read from lse_partial's shape: TileLang 0.1.12 renames a dynamic size
        passed as a macro argument after the parameter, and the two roles' counts would share a name."""
        warp = tid // 32
        lane = tid % 32
        r = lane // 4
        t = lane % 4
        c = C8 if fp8 else C  # chunks per step
        chains = 4 // c  # partial accumulators of a chunk's key GEMM: 4 independent MMA chains per step
        stride = warps * c // chunks_per_page  # pages a warp's step advances
        jagged = ragged and not fp8
        # Loop invariants, computed once into registers (as plain expressions TVM would inline them
        # into the main loop, a 64-bit division included): the split's page range, this warp's
        # steps, and this lane's copy offsets in a page (bytes; codes: its first piece of the
        # warp's first chunk in each page; metadata: field lane // 8, halves 2 (lane % 8) and +1)
        # and shared-memory addresses. FP8 pages: the request's last page holds fp8_last_len tokens.
        split = L.split  # first page id index, chunks, steps of this warp, its first page id index, tokens
        first = page_indptr[bid]
        n_pages = page_indptr[bid + 1] - first
        per_split = T.ceildiv(n_pages, lse_partial.shape[2])
        p_lo = T.min(sid * per_split, n_pages)
        p_hi = T.min(p_lo + per_split, n_pages)
        split[0] = first + p_lo
        if fp8:
            split[4] = T.max(T.min(p_hi * P, (n_pages - 1) * P + fp8_last_len[bid]) - p_lo * P, 0)  # the split's tokens
            split[1] = T.ceildiv(split[4], CHUNK_TOKENS)
        else:
            split[1] = (p_hi - p_lo) * chunks_per_page
        split[2] = T.max(T.ceildiv(split[1], c) - warp + warps - 1, 0) // warps  # steps warp, warp + warps, ...
        split[3] = split[0] + warp * c // chunks_per_page
        page0, n_chunks, n_mine, page_at = split[0], split[1], split[2], split[3]
        first_sub = T.if_then_else(jagged, 0, warp * c % chunks_per_page)  # the warp's first chunk in a page
        lane_off = L.lane_off
        if fp8:
            lane_off[0] = first_sub * CHUNK_TOKENS * H * D + hk * D  # its first token's K/V bytes in a page
        else:
            lane_off[0] = (k_base + hk * k_head_words + lane * vec + first_sub * k_chunk_words) * 4
            if k4:  # the value streams' offset (3-bit: the keys' plus a constant, in copy_chunk)
                lane_off[2] = (v_base + hk * v_head_words + lane * vec + first_sub * chunk_words) * 4
            lane_off[1] = (
                T.if_then_else(lane < 8, kn_base, T.if_then_else(lane < 16, vs_base, vz_base))
                + hk * P
                + (lane % 8) * 2
                + first_sub * CHUNK_TOKENS
            ) * 2
        ring_at = L.ring_at  # this lane's first piece in slot 0, its metadata, its key table column
        meta_ring = L.meta_ring
        if fp8:
            ring_at[0] = T.call_extern(T.uint32, "minima::smem_addr", T.address_of(L.ring[warp * warp_words]))
        else:
            ring_at[0] = T.call_extern(T.uint32, "minima::smem_addr", T.address_of(L.ring[warp * warp_words + lane * vec]))
            ring_at[1] = T.call_extern(T.uint32, "minima::smem_addr", T.address_of(meta_ring[warp * stages * C * chunk_meta + lane * 2]))
            ring_at[2] = T.call_extern(T.uint32, "minima::table_lane", lane)
            if key_center:  # this lane's 16 bytes of slot 0's first mean key
                ring_at[3] = T.call_extern(T.uint32, "minima::smem_addr", T.address_of(L.ring[warp * warp_words + C * kv_chunk_words + lane * 4]))

        q_frag = L.q_frag
        for kb in T.unroll(blocks):
            for nb in T.unroll(NB):
                for j in T.unroll(2):
                    head = nb * HEADS_PER_TILE + r
                    q_frag[(kb * NB + nb) * 2 + j] = T.if_then_else(
                        head < G, query_word(fp8, q_words, bid, hk * G + T.min(head, G - 1), kb, t, j), T.uint32(0)
                    )
        for i in T.unroll(blocks * NB * 4):
            L.acc_o[i] = 0
        for i in T.unroll(NB * 2):
            L.m_i[i] = neg_inf
            L.l_i[i] = 0
            L.z_i[i] = 0
        if not fp8:  # the key table (the FP8 role's CTAs need none)
            T.call_extern("handle", "minima::fill_key_table", warp, warps, lane)
            T.sync_threads()

        acc_m = L.acc_m
        acc_o, acc_s, acc_k, m_i, l_i, z_i, alpha = L.acc_o, L.acc_s, L.acc_k, L.m_i, L.l_i, L.z_i, L.alpha
        meta_cur, chunk_ok, page_next, ring, codes, ops, p_frag = L.meta_cur, L.chunk_ok, L.page_next, L.ring, L.codes, L.ops, L.p_frag
        step_max, step_l, step_z, rescale = L.step_max, L.step_l, L.step_z, L.rescale
        # Each warp streams its steps (c chunks each) through a ring of `stages` slots in shared
        # memory with cp.async: step it + stages - 1 is requested while step it computes, so
        # stages - 1 steps per warp are in flight without holding registers. The warp copies a
        # chunk's code words in adjacent pieces (coalesced: copying each lane's own stream instead
        # wasted half of every 32-byte sector per instruction) and each lane reads back its own
        # stream; the 96 bytes of norms / scales / zeros are copied by 24 lanes. Lanes read what
        # other lanes copied, hence the __syncwarp after the wait.
        # page ids of the next step, loaded one step ahead (ragged: step_pages of them, clamped to
        # the split's last page: a missing chunk's page is not read)
        if fp8:  # a warp with a step has its first page (n_chunks counts tokens, not whole pages)
            page_next[0] = T.if_then_else(n_mine > 0, page_ids[page_at], 0)
        else:
            for ci in T.unroll(step_pages):
                page_next[ci] = T.if_then_else(n_mine > 0, page_ids[T.min(page_at + ci, page0 + n_chunks // chunks_per_page - 1)], 0)
        for it in T.serial(n_mine + stages - 1):
            if it < n_mine:
                slot = it % stages
                for ci in T.unroll(c):
                    page = page_next[ci // chunks_per_page if jagged else 0]
                    if fp8:  # the chunk's tokens before the split's end: the others are zero-filled
                        T.call_extern(
                            "handle",
                            "minima::copy_fp8_chunk",
                            ring_at[0] + (slot * fp8_slot_words + ci * fp8_chunk_words) * 4,
                            T.address_of(pool[0][0, 0, 0, 0]),
                            T.address_of(pool[1][0, 0, 0, 0]),
                            page,
                            lane_off[0] + ci * CHUNK_TOKENS * H * D,
                            lane,
                            split[4] - ((warp + it * warps) * c + ci) * CHUNK_TOKENS,
                        )
                    elif not jagged or (warp + it * warps) * c + ci < n_chunks:
                        code_offsets = [lane_off[0] + (ci % chunks_per_page) * k_chunk_words * 4]
                        if k4:  # the value streams' own offset (3-bit: a constant past the keys')
                            code_offsets.append(lane_off[2] + (ci % chunks_per_page) * chunk_words * 4)
                        T.call_extern(
                            "handle",
                            copy_chunk,
                            ring_at[0] + (slot * slot_words + ci * kv_chunk_words) * 4,
                            ring_at[1] + ((slot * C + ci) * chunk_meta) * 2,
                            T.address_of(pool[page, 0]),
                            *code_offsets,
                            lane_off[1] + (ci % chunks_per_page) * CHUNK_TOKENS * 2,
                            lane < 24,
                        )
                if key_center and not fp8:  # the step's pages' mean keys of head hk, behind its chunks
                    for pi in T.unroll(step_pages):
                        if lane < D // 8:
                            T.call_extern(
                                "handle",
                                "minima::cp_async_to<16>",
                                ring_at[3] + (slot * slot_words + pi * mean_words) * 4,
                                T.address_of(pool[page_next[pi], km_base + hk * mean_words + lane * 4]),
                            )
                if it + 1 < n_mine:
                    if jagged:
                        for ci in T.unroll(step_pages):
                            page_next[ci] = page_ids[T.min(page_at + (it + 1) * stride + ci, page0 + n_chunks // chunks_per_page - 1)]
                    else:
                        page_next[0] = page_ids[page_at + (it + 1) * stride]
            T.call_extern("handle", "minima::cp_async_commit")
            if it >= stages - 1:
                T.call_extern("handle", f"minima::cp_async_wait<{stages - 1}>")
                T.call_extern("handle", "__syncwarp")
                step = it - stages + 1
                if fp8:
                    chunk_at = ring_at[0] + (step % stages * fp8_slot_words) * 4
                    for ci in T.unroll(c):  # tokens r, r + 8 of each chunk: inside the split?
                        for h in T.unroll(2):
                            chunk_ok[ci * 2 + h] = T.Cast(T.int32, ((warp + step * warps) * c + ci) * CHUNK_TOKENS + r + 8 * h < split[4])
                else:
                    slot_base = warp * warp_words + step % stages * slot_words + lane * lane_words
                    k_slot_base = warp * warp_words + step % stages * slot_words + lane * k_lane_words
                    meta_base = (warp * stages + step % stages) * C * chunk_meta
                    for ci in T.unroll(C):
                        chunk_ok[ci] = T.Cast(T.int32, (warp + step * warps) * C + ci < n_chunks)
                        for j in T.unroll(2):
                            for f in T.unroll(3):
                                meta_cur[ci * 6 + 2 * f + j] = T.Cast(
                                    T.float32, meta_ring[meta_base + ci * chunk_meta + f * CHUNK_TOKENS + r + 8 * j]
                                )
                            meta_cur[ci * 6 + j] *= score_scale  # k_norm * sm_scale * log2 e: one factor per score
                            if ragged:  # a missing chunk: no probability mass (its shared memory is stale)
                                meta_cur[ci * 6 + 2 + j] = T.if_then_else(chunk_ok[ci] != 0, meta_cur[ci * 6 + 2 + j], 0)
                                meta_cur[ci * 6 + 4 + j] = T.if_then_else(chunk_ok[ci] != 0, meta_cur[ci * 6 + 4 + j], 0)
                    if key_center:
                        # q'.m of each page of the step: m in every row of the A operand (rows r and r + 8 of
                        # k-block kb are dims 16 kb + 2t (+1) and + 8 (+1): words 8 kb + t and + 4), so every
                        # lane's accumulator holds it for its heads 2t, 2t + 1; scaled as the scores are
                        mean_base = warp * warp_words + step % stages * slot_words + C * kv_chunk_words
                        for pi in T.unroll(step_pages):
                            for i in T.unroll(NB * 4):
                                acc_m[pi * NB * 4 + i] = 0
                            for kb in T.unroll(blocks):
                                ops[0] = ring[mean_base + pi * mean_words + 8 * kb + t]
                                ops[1] = ops[0]
                                ops[2] = ring[mean_base + pi * mean_words + 8 * kb + t + 4]
                                ops[3] = ops[2]
                                for nb in T.unroll(NB):
                                    T.call_extern(
                                        "handle",
                                        "minima::mma_16816",
                                        T.address_of(acc_m[(pi * NB + nb) * 4]),
                                        T.address_of(ops[0]),
                                        T.address_of(q_frag[(kb * NB + nb) * 2]),
                                    )
                            for i in T.unroll(NB * 4):
                                acc_m[pi * NB * 4 + i] *= score_scale
                # scores^T = K . q'^T per chunk, 64 dims at a time (4 k-blocks of 16 dims each)
                for ci in T.unroll(c):
                    if not fp8:
                        for j in T.unroll(k_pieces):
                            for e in T.vectorized(vec):
                                codes[j * vec + e] = ring[k_slot_base + ci * kv_chunk_words + j * vec + e]
                    for i in T.unroll(chains * NB * 4):
                        acc_k[ci * chains * NB * 4 + i] = 0
                    for tr in T.unroll(triples):
                        if fp8:
                            T.call_extern("handle", "minima::fp8_keys", chunk_at + ci * fp8_chunk_words * 4, r, t, tr, T.address_of(ops[0]))
                        elif k4:
                            T.call_extern("handle", "minima::k4_keys", T.address_of(codes[tr * 4]), ring_at[2], T.address_of(ops[0]))
                        else:
                            T.call_extern("handle", "minima::tq3_keys", T.address_of(codes[tr * 3]), ring_at[2], T.address_of(ops[0]))
                        for kk in T.unroll(4):
                            for nb in T.unroll(NB):
                                T.call_extern(
                                    "handle",
                                    "minima::mma_16816",
                                    T.address_of(acc_k[((ci * chains + kk % chains) * NB + nb) * 4]),
                                    T.address_of(ops[kk * 4]),
                                    T.address_of(q_frag[((tr * 4 + kk) * NB + nb) * 2]),
                                )
                    for i in T.unroll(NB * 4):
                        acc_s[ci * NB * 4 + i] = acc_k[ci * chains * NB * 4 + i]
                        for ch in T.unroll(1, chains):
                            acc_s[ci * NB * 4 + i] += acc_k[(ci * chains + ch) * NB * 4 + i]
                # online softmax over the step; this thread holds tokens r, r + 8 of each chunk for
                # heads 2t, 2t + 1
                rescale[0] = 0
                for nb in T.unroll(NB):
                    for j in T.unroll(2):
                        step_max[0] = neg_inf
                        for ci in T.unroll(c):
                            for h in T.unroll(2):  # token r + 8 h
                                score = ci * NB * 4 + nb * 4 + 2 * h + j
                                if fp8:  # one scale for all tokens (k_scale * sm_scale * log2 e); tokens past the split: -inf
                                    acc_s[score] = T.if_then_else(chunk_ok[ci * 2 + h] != 0, acc_s[score] * score_scale, neg_inf)
                                else:
                                    acc_s[score] = acc_s[score] * meta_cur[ci * 6 + h]
                                    if key_center:  # + q'.m of the chunk's page
                                        acc_s[score] += acc_m[((ci // chunks_per_page if ragged else 0) * NB + nb) * 4 + j]
                                    if ragged:
                                        acc_s[score] = T.if_then_else(chunk_ok[ci] != 0, acc_s[score], neg_inf)
                                step_max[0] = T.max(step_max[0], acc_s[score])
                        c4 = T.max(step_max[0], T.shfl_xor(step_max[0], 4))
                        c8 = T.max(c4, T.shfl_xor(c4, 8))
                        c16 = T.max(c8, T.shfl_xor(c8, 16))
                        m_new = T.max(m_i[nb * 2 + j], c16)
                        alpha[nb * 2 + j] = T.call_extern(T.float32, "minima::ex2", m_i[nb * 2 + j] - m_new)
                        rescale[0] = rescale[0] | T.Cast(T.int32, m_new != m_i[nb * 2 + j])
                        m_i[nb * 2 + j] = m_new
                        step_l[0] = 0
                        step_z[0] = 0
                        for ci in T.unroll(c):
                            for h in T.unroll(2):
                                p = T.call_extern(T.float32, "minima::ex2", acc_s[ci * NB * 4 + nb * 4 + 2 * h + j] - m_new)
                                step_l[0] += p
                                if fp8:  # the value scale is one per layer: applied to the output
                                    acc_s[ci * NB * 4 + nb * 4 + 2 * h + j] = p
                                else:
                                    step_z[0] += p * meta_cur[ci * 6 + 4 + h]
                                    acc_s[ci * NB * 4 + nb * 4 + 2 * h + j] = p * meta_cur[ci * 6 + 2 + h]
                        l_i[nb * 2 + j] = l_i[nb * 2 + j] * alpha[nb * 2 + j] + step_l[0]
                        if not fp8:
                            z_i[nb * 2 + j] = z_i[nb * 2 + j] * alpha[nb * 2 + j] + step_z[0]
                    for ci in T.unroll(c):
                        for h in T.unroll(2):  # tokens r (h=0) / r + 8 (h=1) -> B operand rows
                            p_frag[(ci * NB + nb) * 2 + h] = T.call_extern(
                                T.uint32,
                                "minima::transpose8x8",
                                T.call_extern(
                                    T.uint32,
                                    "minima::pack_half2",
                                    acc_s[ci * NB * 4 + nb * 4 + 2 * h],
                                    acc_s[ci * NB * 4 + nb * 4 + 2 * h + 1],
                                ),
                            )
                # rescale the output only when some running max moved (rare once the max settles)
                if T.call_extern(T.int32, "__any_sync", T.uint32(0xFFFFFFFF), rescale[0]) != 0:
                    for mb in T.unroll(blocks):
                        for nb in T.unroll(NB):
                            for i in T.unroll(4):
                                acc_o[(mb * NB + nb) * 4 + i] *= alpha[nb * 2 + i % 2]
                # out'^T += V^T . (p * v_scale)^T, chunk by chunk
                for ci in T.unroll(c):
                    if not fp8:
                        for j in T.unroll(TRIPLE_WORDS):
                            for e in T.vectorized(vec):
                                codes[j * vec + e] = ring[slot_base + ci * kv_chunk_words + k_chunk_words + j * vec + e]
                    for tr in T.unroll(triples):
                        if fp8:
                            T.call_extern("handle", "minima::fp8_values", chunk_at + ci * fp8_chunk_words * 4, r, t, tr, T.address_of(ops[0]))
                        else:
                            T.call_extern("handle", "minima::tq3_values", T.address_of(codes[tr * 3]), T.address_of(ops[0]))
                        for kk in T.unroll(4):
                            for nb in T.unroll(NB):
                                T.call_extern(
                                    "handle",
                                    "minima::mma_16816",
                                    T.address_of(acc_o[((tr * 4 + kk) * NB + nb) * 4]),
                                    T.address_of(ops[kk * 4]),
                                    T.address_of(p_frag[(ci * NB + nb) * 2]),
                                )
                T.call_extern("handle", "__syncwarp")  # the slot is refilled next iteration

        # combine: the 8 token rows of a head live in lanes t, t + 4, ..., t + 28. Each warp's
        # output rows go to its own part of the ring (its copies are all done: only empty groups
        # were committed after its last step).
        T.call_extern("handle", "minima::cp_async_wait<0>")
        T.call_extern("handle", "__syncwarp")
        for i in T.unroll(NB * 2):
            for off in T.unroll(3):
                l_i[i] += T.shfl_xor(l_i[i], 4 * (1 << off))
                if not fp8:
                    z_i[i] += T.shfl_xor(z_i[i], 4 * (1 << off))
        stat_s = L.stat_s
        for nb in T.unroll(NB):
            for j in T.unroll(2):
                head = nb * HEADS_PER_TILE + 2 * t + j
                if r == 0 and head < G:
                    stat_s[0, warp, head] = m_i[nb * 2 + j]
                    stat_s[1, warp, head] = l_i[nb * 2 + j]
                    stat_s[2, warp, head] = z_i[nb * 2 + j]
            for mb in T.unroll(blocks):
                for i in T.unroll(4):
                    head = nb * HEADS_PER_TILE + 2 * t + i % 2
                    # the value GEMM's row order: the FP8 role's is _fp8_device_source's
                    dim = 32 * (mb // 2) + 4 * r + 2 * (mb % 2) + i // 2 if fp8 else mb * 16 + r + 8 * (i // 2)
                    if head < G:
                        ring[warp * warp_words + head * D + dim] = T.reinterpret(acc_o[(mb * NB + nb) * 4 + i], T.uint32)
        T.sync_threads()
        m_all, den, num = L.m_all, L.den, L.num
        for e in T.serial(T.ceildiv(G * D, warps * 32)):
            idx = e * warps * 32 + tid
            if idx < G * D:
                head = idx // D
                d = idx % D
                m_all[0] = stat_s[0, 0, head]
                for w in T.unroll(1, warps):
                    m_all[0] = T.max(m_all[0], stat_s[0, w, head])
                den[0] = 0
                num[0] = 0
                if m_all[0] > neg_inf:
                    for w in T.unroll(warps):
                        wgt = T.exp2(stat_s[0, w, head] - m_all[0])
                        den[0] += wgt * stat_s[1, w, head]
                        num[0] += wgt * (T.reinterpret(ring[w * warp_words + head * D + d], T.float32) + stat_s[2, w, head])
                if fp8:
                    num[0] *= L.v_scale[0]
                out_partial[bid, hk * G + head, sid, d] = T.if_then_else(den[0] > 0, num[0] / den[0], T.float32(0))
                if d == 0:
                    lse_partial[bid, hk * G + head, sid] = T.if_then_else(den[0] > 0, T.log2(den[0]) + m_all[0], neg_inf)

    def buffers():
        """The split body's registers and shared memory, one set for both roles."""
        return SimpleNamespace(
            q_frag=T.alloc_local([blocks * NB * 2], T.uint32),
            acc_o=T.alloc_local([blocks * NB * 4], T.float32),
            acc_s=T.alloc_local([CM * NB * 4], T.float32),
            acc_k=T.alloc_local([4 * NB * 4], T.float32),
            acc_m=T.alloc_local([step_pages * NB * 4 if key_center else 1], T.float32),  # q'.m per page of the step
            m_i=T.alloc_local([NB * 2], T.float32),
            l_i=T.alloc_local([NB * 2], T.float32),
            z_i=T.alloc_local([NB * 2], T.float32),
            alpha=T.alloc_local([NB * 2], T.float32),
            step_max=T.alloc_local([1], T.float32),
            step_l=T.alloc_local([1], T.float32),
            step_z=T.alloc_local([1], T.float32),
            p_frag=T.alloc_local([CM * NB * 2], T.uint32),
            ops=T.alloc_local([PAIRS_PER_TRIPLE], T.uint32),
            codes=T.alloc_local([k_lane_words], T.uint32),  # one chunk's K or V words of this lane
            meta_cur=T.alloc_local([C * 6], T.float32),  # per chunk: k_norm (x score scale), v_scale, v_zero of tokens r, r + 8
            chunk_ok=T.alloc_local([max(C, 2 * C8)], T.int32),  # TQ3: per chunk; FP8: per token row r, r + 8 of a chunk
            ring=T.alloc_shared([warps * warp_words], T.uint32),
            meta_ring=T.alloc_shared([warps * stages * C * chunk_meta], T.float16),
            page_next=T.alloc_local([step_pages], T.int32),
            rescale=T.alloc_local([1], T.int32),
            m_all=T.alloc_local([1], T.float32),
            den=T.alloc_local([1], T.float32),
            num=T.alloc_local([1], T.float32),
            stat_s=T.alloc_shared([3, warps, G], T.float32),  # m, l, z per warp and head
            split=T.alloc_local([5 if C8 else 4], T.int32),
            lane_off=T.alloc_local([3 if k4 else 2], T.int32),
            ring_at=T.alloc_local([4 if key_center else 3], T.uint32),
            v_scale=T.alloc_local([1], T.float32),
        )

    batch, num_pages, nnz, num_splits = T.dynamic("batch, num_pages, nnz, num_splits")
    if not C8:

        @T.prim_func
        def tq3_decode(
            q_words: T.Tensor([batch, heads, D // 2], T.int32),
            pool_words: T.Tensor([num_pages, page_words], T.int32),
            page_indptr: T.Tensor([batch + 1], T.int32),
            page_ids: T.Tensor([nnz], T.int32),
            out_partial: T.Tensor([batch, heads, num_splits, D], T.float32),
            lse_partial: T.Tensor([batch, heads, num_splits], T.float32),
        ):
            with T.Kernel(num_splits, H, batch, threads=warps * 32) as (sid, hk, bid):
                T.import_source(source)
                T.annotate_min_blocks_per_sm(min_blocks)
                L = buffers()
                split_body(False, sid, hk, bid, T.get_thread_binding(), q_words, pool_words, page_indptr, page_ids, None, T.float32(scale), out_partial, lse_partial, L)

        return tq3_decode

    num_fp8_pages, fp8_nnz, num_fp8_splits = T.dynamic("num_fp8_pages, fp8_nnz, num_fp8_splits")

    @T.prim_func
    def mixed_decode(
        q_words: T.Tensor([batch, heads, D // 2], T.int32),
        q8_words: T.Tensor([batch, heads, D // 2], T.int32),
        pool_words: T.Tensor([num_pages, page_words], T.int32),
        k_pool: T.Tensor([num_fp8_pages, P, H, D], T.uint8),
        v_pool: T.Tensor([num_fp8_pages, P, H, D], T.uint8),
        page_indptr: T.Tensor([batch + 1], T.int32),
        page_ids: T.Tensor([nnz], T.int32),
        fp8_indptr: T.Tensor([batch + 1], T.int32),
        fp8_ids: T.Tensor([fp8_nnz], T.int32),
        fp8_last_len: T.Tensor([batch], T.int32),
        k_scale: T.float32,
        v_scale: T.float32,
        out_partial: T.Tensor([batch, heads, num_splits, D], T.float32),
        lse_partial: T.Tensor([batch, heads, num_splits], T.float32),
        fp8_out_partial: T.Tensor([batch, heads, num_fp8_splits, D], T.float32),
        fp8_lse_partial: T.Tensor([batch, heads, num_fp8_splits], T.float32),
    ):
        with T.Kernel(num_splits + num_fp8_splits, H, batch, threads=warps * 32) as (sid, hk, bid):
            T.import_source(source)
            T.annotate_min_blocks_per_sm(min_blocks)
            L = buffers()
            tid = T.get_thread_binding()
            if sid < num_splits:
                split_body(False, sid, hk, bid, tid, q_words, pool_words, page_indptr, page_ids, None, T.float32(scale), out_partial, lse_partial, L)
            else:
                L.v_scale[0] = v_scale
                split_body(
                    True, sid - num_splits, hk, bid, tid, q8_words, (k_pool, v_pool), fp8_indptr, fp8_ids, fp8_last_len,
                    k_scale * T.float32(scale), fp8_out_partial, fp8_lse_partial, L,
                )

    return mixed_decode
