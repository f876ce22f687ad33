"""TQ3P: the packed byte layout of one Stale (TQ3) page, defined once.

The torch codec, the TileLang kernels and the byte accounting all import these constants,
``TQ3PageLayout``, ``WORD_BITS``, ``pair_coords``, ``code_bit_index``, ``lane_word``, ``triple_codes`` and
(4-bit codes) ``code4_bit_index``, ``key4_bit_index``, ``key4_word``, ``key4_word_codes``;
docs/TQ3P.md describes the same layout in prose.

One TQ3 page holds ``page_size`` tokens of one layer, all KV heads. It is one contiguous uint8 block:

    offset 0                       k_codes  [num_kv_heads] blocks of page_size*head_dim*key_bits/8 bytes
    + kc                           v_codes  [num_kv_heads] blocks of page_size*head_dim*value_bits/8 bytes
    + kc + vc                      k_norm   fp16  [num_kv_heads, page_size]   key norm correction
    + kc + vc + meta               v_scale  fp16  [num_kv_heads, page_size]
    + kc + vc + 2*meta             v_zero   fp16  [num_kv_heads, page_size]   (``uniform`` values only)
    + kc + vc + (1 + vm)*meta      k_mean   fp16  [num_kv_heads, head_dim]    (``key_center`` only)

(kc = H*P*D*key_bits/8, vc = H*P*D*value_bits/8, meta = H*P*2, vm = 2 or 1 value fields.) Head-major,
so one CTA working on one KV head reads one contiguous run of codes per page. ``key_bits`` is 3 (TQ3,
this class's default) or 4 (keys with a 16-level codebook: the server's default, ``--minima-key-bits``);
``value_bits`` is 3 (the default) or 4 (values on a 16-level grid, ``--minima-value-bits``). With ``key_center`` (page-centered keys, ``--minima-key-center``) the key
codes and norms are those of each rotated key minus its page's mean key per head, and ``k_mean`` holds
that mean (rounded to fp16): 16 bits per key element per page, 0.25 per element at 64-token pages.

``value_code`` says what a value code means (``--minima-value-code``): ``uniform`` (the default), the
level ``scale * c + zero`` of a per-token min/max grid (two fp16 fields); ``lloyd-max``, the rotated
value coded as 3-bit keys are (Lloyd-Max codes of the vector scaled to norm sqrt(D)) and decoded as
``scale * centroid[c]``, one fp16 field, the least-squares scale for those codes (no ``v_zero``: 16
bits per value element per token fewer). Both pack their codes the same way (value MMA order below).

Codes are stored in the order the decode kernel's tensor-core fragments consume them ("MMA order"),
so that each lane of a warp copies its own words with coalesced vector copies and turns them into
fp16 operands with a few bit operations, without a decoded tile in shared memory:

* a head's block is split into chunks of 16 tokens (one MMA tile); a chunk is 32 lane streams of
  3*D/16 bytes (D/4 code pairs each), lane after lane;
* a lane's pair ``p`` feeds register ``p % 4`` of the m16n8k16 A operand of 16-wide block ``p // 4``.
  Keys (scores = K . q^T: rows are tokens, k is the head dim): lane 4r+t, block kb, register g holds
  token r + 8(g&1), dims 16kb + 2t + 8(g>>1) and the next one. Values (out^T = V^T . p^T: rows are
  dims, k is tokens): dim 16kb + r + 8(g&1), tokens 2t + 8(g>>1) and the next one;
* a lane stream is a sequence of 96-bit triples (three little-endian uint32 words) of 16 pairs. Pair
  q < 15 sits in word q // 5, slot i = q % 5, pair 15 in the spare bits (bit b of its codes in word
  b). Keys and values place their slots differently, each for its decode (``WORD_BITS``).
  Values: low code at bits 1+3i .. 3+3i, high code 16 above, so ``(w >> s) & 0x00070007`` gives
  both halves of an fp16x2 at once (spare bits 0 / 16). Keys: the pair is one 6-bit field (low
  code, then high code) at bits 0, 7, 13, 19, 26 (spare bits 6 / 25), the index into a 64-entry
  table of fp16x2 centroid pairs.

4-bit keys (``key_bits=4``) keep the chunk / lane / pair order above (a lane's pair ``p`` is register
``p % 4`` of block ``p // 4``, the same (token, dim)s: ``pair_coords``); only the packing of a lane
stream differs. A pair is one byte, low code in bits 0..3 and high code in bits 4..7, so the byte is
the index ``low | high << 4`` into a 256-entry table of fp16x2 centroid pairs; a lane stream is D/4
bytes = D/16 little-endian uint32 words, word ``k`` holding pairs 4k .. 4k+3 (byte ``g`` = register
``g`` of block ``k``: one word is one block's whole A operand). A chunk is 32 lane streams of D/4
bytes (8*D bytes), lane after lane; no triples, no spare bits (``key4_bit_index``). 4-bit values
(``value_bits=4``) have the same lane streams of D/16 words in the values' MMA order (a pair is tokens
2t and 2t + 1 of one dim), but word ``k`` keeps pair ``4k + g``'s low code in bits 4g..4g+3 and its high
code 16 above, so one shift and one mask give both halves of an fp16x2, as for 3-bit values
(``code4_bit_index``, ``NIBBLE_BITS``).

LSE convention for every Minima attention op (torch and GPU): base 2, as FlashInfer returns it.
"""

from __future__ import annotations

from dataclasses import dataclass

TQ3_BITS = 3
NUM_CODES = 1 << TQ3_BITS
KEY_BITS_CHOICES = (3, 4)  # key code widths a page may use (``TQ3PageLayout.key_bits``)
VALUE_BITS_CHOICES = (3, 4)  # value code widths (``TQ3PageLayout.value_bits``)
PAIR_BITS_4 = 8  # 4-bit codes: the bits of one pair (low code, high code)
CHUNK_TOKENS = 16  # tokens per MMA tile (the M of the key GEMM, the K of the value GEMM)
LANES = 32  # lane streams per chunk (one warp)
PAIRS_PER_TRIPLE = 16  # code pairs (fp16x2 operands) per 96-bit triple
TRIPLE_WORDS = 3
PAIRS_PER_WORD = 5  # pairs 0..14 of a triple, 5 per word; pair 15 lives in the spare bits
HEAD_DIM_MULTIPLE = 64  # D/4 pairs per lane must fill whole triples
KEY, VALUE = "k", "v"
META_DTYPE_BYTES = 2  # fp16 norm / scale / zero
K_META_FIELDS = 1  # k_norm
V_META_FIELDS = 2  # v_scale, v_zero (``uniform`` values; ``lloyd-max`` values keep v_scale only)
UNIFORM_VALUES, LLOYD_MAX_VALUES = "uniform", "lloyd-max"
VALUE_CODES = (UNIFORM_VALUES, LLOYD_MAX_VALUES)  # what a value code means (``TQ3PageLayout.value_code``)
FP8_BYTES = 1  # e4m3
PAGE_ALIGN = 16  # page blocks start on 16-byte boundaries (vectorized loads)

LSE_BASE = 2.0


def value_meta_fields(value_code: str) -> int:
    """fp16 fields per value token and head: scale and zero (``uniform``), or the scale (``lloyd-max``)."""
    return V_META_FIELDS if value_code == UNIFORM_VALUES else 1


def page_size_fits(page_size: int) -> bool:
    """The page-size rule: a TQ3 page holds whole CHUNK_TOKENS-token tensor-core tiles."""
    return page_size > 0 and page_size % CHUNK_TOKENS == 0


def head_dim_fits(head_dim: int) -> bool:
    """The head-dim rule: each lane's D/4 code pairs fill whole 96-bit triples."""
    return head_dim > 0 and head_dim % HEAD_DIM_MULTIPLE == 0


@dataclass(frozen=True)
class WordBits:
    """Where the codes of one triple word sit, for one kind (docs/TQ3P.md, "Triples")."""

    low: tuple[int, ...]  # bit of the low code of slot i (pair 5k + i of word k), i = 0..4
    high_offset: int  # the slot's high code sits this many bits above its low code
    spare: tuple[int, int]  # pair 15: bit b of its low / high code is this bit of word b


NIBBLE_BITS = {
    # 4-bit codes, four pairs a word: (bits between slots, bits from a slot's low code to its high one)
    KEY: (PAIR_BITS_4, PAIR_BITS_4 // 2),  # a byte a pair: the index into a 256-entry pair table
    VALUE: (PAIR_BITS_4 // 2, 16),  # low codes in the low half-word, high codes 16 above: fp16x2 at a shift
}

WORD_BITS = {
    # values: (w >> s) & 0x00070007 puts both codes of slots 0, 1, 2 (s = 1, 4, 7) and, after one
    # w >> 9, of slots 3, 4 into the mantissas of an fp16x2 (the decode's magic-number trick)
    VALUE: WordBits(low=(1, 4, 7, 10, 13), high_offset=16, spare=(0, 16)),
    # keys: a slot is a 6-bit table index; slot 1 already sits where the table's byte offset wants it
    # (bits 7..12: one lop3 gives the offset), the others are one shift away from it
    KEY: WordBits(low=(0, 7, 13, 19, 26), high_offset=3, spare=(6, 25)),
}


@dataclass(frozen=True)
class TQ3PageLayout:
    """Byte offsets of one TQ3P page for a given (num_kv_heads, page_size, head_dim, key_bits, key_center,
    value_code, value_bits).

    ``key_bits`` / ``value_bits`` are the key / value code widths, 3 (TQ3) or 4. With a 4-bit side
    the key and value code blocks differ in size: ``k_code_bytes`` / ``v_code_bytes`` (and the
    per-head, per-token forms) name each; ``code_bytes``, ``head_code_bytes``, ``code_bytes_per_token``
    and ``lane_words`` are the 3-bit block's, shared by keys and values only when both are 3-bit."""

    num_kv_heads: int
    page_size: int
    head_dim: int
    key_bits: int = TQ3_BITS
    key_center: bool = False
    value_code: str = UNIFORM_VALUES
    value_bits: int = TQ3_BITS

    def __post_init__(self) -> None:
        if self.value_code not in VALUE_CODES:
            raise ValueError(f"TQ3 value codes are {' or '.join(VALUE_CODES)}, got value_code={self.value_code!r}")
        if self.key_bits not in KEY_BITS_CHOICES:
            raise ValueError(f"TQ3 key codes are {' or '.join(map(str, KEY_BITS_CHOICES))} bits wide, got key_bits={self.key_bits}")
        if self.value_bits not in VALUE_BITS_CHOICES:
            raise ValueError(
                f"TQ3 value codes are {' or '.join(map(str, VALUE_BITS_CHOICES))} bits wide, got value_bits={self.value_bits}"
            )
        if not head_dim_fits(self.head_dim):
            raise ValueError(
                f"TQ3 needs head_dim to be a positive multiple of {HEAD_DIM_MULTIPLE}, got {self.head_dim}"
            )
        if not page_size_fits(self.page_size):
            raise ValueError(
                f"TQ3 needs page_size to be a positive multiple of {CHUNK_TOKENS}, got {self.page_size}"
            )
        if self.num_kv_heads <= 0:
            raise ValueError(f"TQ3 needs a positive num_kv_heads, got {self.num_kv_heads}")

    def _shared_3bit(self, name: str) -> None:
        if self.key_bits != TQ3_BITS or self.value_bits != TQ3_BITS:
            raise ValueError(
                f"TQ3PageLayout.{name} is the 3-bit code block's, which keys and values share only when both are "
                f"3-bit (key_bits={self.key_bits}, value_bits={self.value_bits}): use k_{name} / v_{name}"
            )

    @property
    def code_bytes_per_token(self) -> int:
        """Packed code bytes of one token of one head (K or V; 3-bit codes only)."""
        self._shared_3bit("code_bytes_per_token")
        return self.v_code_bytes_per_token

    @property
    def lane_words(self) -> int:
        """uint32 words of one lane stream of one chunk (3*D/64: 3, 6, 12 for D = 64, 128, 256;
        3-bit codes only)."""
        self._shared_3bit("lane_words")
        return lane_words(self.head_dim)

    @property
    def head_code_bytes(self) -> int:
        """Packed code bytes of one head of one page, K or V (3-bit codes only)."""
        self._shared_3bit("head_code_bytes")
        return self.v_head_code_bytes

    @property
    def code_bytes(self) -> int:
        """Packed code bytes of one page, K or V (3-bit codes only)."""
        self._shared_3bit("code_bytes")
        return self.v_code_bytes

    @property
    def k_code_bytes_per_token(self) -> int:
        """Packed key code bytes of one token of one head: D*key_bits/8."""
        return self.head_dim * self.key_bits // 8

    @property
    def v_code_bytes_per_token(self) -> int:
        """Packed value code bytes of one token of one head: D*value_bits/8."""
        return self.head_dim * self.value_bits // 8

    @property
    def k_lane_words(self) -> int:
        """uint32 words of one key lane stream of one chunk (key_bits*D/64)."""
        return lane_words(self.head_dim, self.key_bits)

    @property
    def v_lane_words(self) -> int:
        """uint32 words of one value lane stream of one chunk (value_bits*D/64)."""
        return lane_words(self.head_dim, self.value_bits)

    @property
    def k_head_code_bytes(self) -> int:
        """Packed key code bytes of one head of one page."""
        return self.page_size * self.k_code_bytes_per_token

    @property
    def v_head_code_bytes(self) -> int:
        """Packed value code bytes of one head of one page."""
        return self.page_size * self.v_code_bytes_per_token

    @property
    def k_code_bytes(self) -> int:
        """Packed key code bytes of one page (all heads)."""
        return self.num_kv_heads * self.k_head_code_bytes

    @property
    def v_code_bytes(self) -> int:
        """Packed value code bytes of one page (all heads)."""
        return self.num_kv_heads * self.v_head_code_bytes

    @property
    def meta_bytes(self) -> int:
        """Bytes of one fp16 metadata field over one page."""
        return self.num_kv_heads * self.page_size * META_DTYPE_BYTES

    @property
    def k_codes_offset(self) -> int:
        return 0

    @property
    def v_codes_offset(self) -> int:
        return self.k_code_bytes

    @property
    def k_norm_offset(self) -> int:
        return self.payload_bytes

    @property
    def v_scale_offset(self) -> int:
        return self.payload_bytes + self.meta_bytes

    @property
    def v_zero_offset(self) -> int:
        """The values' zero points, fp16 [H, P] (``uniform`` values only)."""
        if self.value_code != UNIFORM_VALUES:
            raise ValueError(f"TQ3PageLayout.v_zero_offset: {self.value_code} values have no v_zero field")
        return self.payload_bytes + 2 * self.meta_bytes

    @property
    def v_meta_fields(self) -> int:
        return value_meta_fields(self.value_code)

    @property
    def kernel_unread(self) -> list[str]:
        """This layout's options the GPU kernels neither read nor write, each with its flag (empty: they
        serve it): where the decode backend refuses the pool and the store converts on the torch codec."""
        return kernel_unread_options(self.value_code, self.value_bits)

    @property
    def k_mean_offset(self) -> int:
        """The page's mean keys per head, fp16 [H, D] (``key_center`` only)."""
        if not self.key_center:
            raise ValueError("TQ3PageLayout.k_mean_offset: this layout has no k_mean field (key_center=False)")
        return self.payload_bytes + (K_META_FIELDS + self.v_meta_fields) * self.meta_bytes

    @property
    def k_mean_bytes(self) -> int:
        """Bytes of the k_mean field of one page: H*D fp16 with ``key_center``, else 0."""
        return self.num_kv_heads * self.head_dim * META_DTYPE_BYTES if self.key_center else 0

    @property
    def payload_bytes(self) -> int:
        """Code bytes of one page (K and V)."""
        return self.k_code_bytes + self.v_code_bytes

    @property
    def metadata_bytes(self) -> int:
        """Norm / scale / zero (and, with ``key_center``, mean-key) bytes of one page."""
        return (K_META_FIELDS + self.v_meta_fields) * self.meta_bytes + self.k_mean_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of one page block including alignment padding."""
        raw = self.payload_bytes + self.metadata_bytes
        return (raw + PAGE_ALIGN - 1) // PAGE_ALIGN * PAGE_ALIGN


def kernel_unread_options(value_code: str, value_bits: int) -> list[str]:
    """``TQ3PageLayout.kernel_unread`` from the options alone (no geometry: what the launcher has).
    Page-centered keys are served (the decodes add q'.m, the conversions write and read the mean)."""
    return [what for what, on in (
        (f"{value_code} values (--minima-value-code {value_code})", value_code != UNIFORM_VALUES),
        (f"{value_bits}-bit values (--minima-value-bits {value_bits})", value_bits != TQ3_BITS),
    ) if on]


def fp8_page_bytes(num_kv_heads: int, page_size: int, head_dim: int, v_head_dim: int | None = None) -> int:
    """Bytes of one FP8 page of one layer (K and V, no metadata: scales are per layer)."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    return num_kv_heads * page_size * (head_dim + v_head_dim) * FP8_BYTES


def lane_words(head_dim: int, bits: int = TQ3_BITS) -> int:
    """uint32 words of one lane stream of one chunk: D/4 pairs of 2*bits bits (3*D/64; 4-bit codes: D/16)."""
    return head_dim * bits // 64


def _mma_slot(kind: str, tc, dd):
    """(r, t, half, register) of the code of chunk token ``tc`` and block dim ``dd`` (0..15) in ``kind``'s
    MMA order: lane 4r + t, ``half`` 0 / 1 for the pair's low / high code (``pair_coords``' inverse)."""
    if kind == KEY:
        return tc % 8, (dd % 8) // 2, dd % 2, tc // 8 + 2 * (dd // 8)
    if kind == VALUE:
        return dd % 8, (tc % 8) // 2, tc % 2, dd // 8 + 2 * (tc // 8)
    raise ValueError(f"kind must be {KEY!r} or {VALUE!r}, got {kind!r}")


def code4_bit_index(kind: str, token, dim, bit, head_dim: int):
    """4-bit codes: bit index, inside one head's ``kind`` code block of a page, of bit ``bit`` (0..3)
    of the code of (``token``, ``dim``); byte ``i // 8``, bit ``i % 8``. The pair holding (token, dim)
    is the MMA-order pair of ``code_bit_index`` (lane 4r + t, pair p = 4*block + register), in word
    ``(32*chunk + lane) * D/16 + p // 4`` of the block, slot ``g = p % 4`` (``NIBBLE_BITS``): keys put the
    pair in byte g (low code, the even dim, in bits 8g..8g+3, the high code 4 above: one table index);
    values put the low code (the even token) in bits 4g..4g+3 and the high code 16 above, so that
    ``(w >> 4g) & 0x000F000F`` is both halves of an fp16x2 (the 3-bit values' trick). Integer arithmetic
    only (// % * +), so ints, tensors and TileLang expressions all index with it."""
    chunk, tc = token // CHUNK_TOKENS, token % CHUNK_TOKENS
    block, dd = dim // 16, dim % 16
    r, t, half, reg = _mma_slot(kind, tc, dd)
    pair = 4 * block + reg
    word = (chunk * LANES + 4 * r + t) * (head_dim // 16) + pair // 4
    stride, high = NIBBLE_BITS[kind]
    return word * 32 + stride * (pair % 4) + high * half + bit


def key4_bit_index(token, dim, bit, head_dim: int):
    """4-bit keys: ``code4_bit_index`` of the key block (the low code of a pair is the even dim)."""
    return code4_bit_index(KEY, token, dim, bit, head_dim)


def key4_word(lane, word, code):
    """4-bit keys: uint32 word ``word`` of lane ``lane``'s key stream of one chunk, the OR of its
    four pair bytes (pairs 4*word .. 4*word+3, byte g = pair 4*word+g = ``low | high << 4``).
    ``code(token, dim)`` gives a token's code as an unsigned integer; integer operators only (ints,
    tensors or TileLang expressions: the FP8 -> TQ3 kernel packs with it); the inverse of
    ``key4_word_codes``, and the bytes ``key4_bit_index`` addresses."""
    value = 0
    for g in range(4):
        (t0, d0), (t1, d1) = pair_coords(KEY, lane, 4 * word + g)
        value = value | (code(t0, d0) << (PAIR_BITS_4 * g)) | (code(t1, d1) << (PAIR_BITS_4 * g + PAIR_BITS_4 // 2))
    return value


def key4_word_codes(w):
    """The 4 (low code, high code) of one 4-bit key word ``w`` (pairs 4*word .. 4*word+3 of its lane,
    ``pair_coords`` places them): the inverse of ``key4_word``. Every field is masked, so a signed
    int32 word gives the same codes."""
    mask = (1 << (PAIR_BITS_4 // 2)) - 1
    return [((w >> (PAIR_BITS_4 * g)) & mask, (w >> (PAIR_BITS_4 * g + PAIR_BITS_4 // 2)) & mask) for g in range(4)]


def pair_coords(kind: str, lane: int, pair: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(token, dim) of the low and high code of ``pair`` of ``lane``, inside one 16-token chunk.
    Integer arithmetic only (// % & >> * +), so ``lane`` and ``pair`` may also be TileLang expressions."""
    block, reg = pair // 4, pair % 4
    r, t = lane // 4, lane % 4
    if kind == KEY:
        token, dim = r + 8 * (reg & 1), 16 * block + 2 * t + 8 * (reg >> 1)
        return (token, dim), (token, dim + 1)
    if kind == VALUE:
        token, dim = 2 * t + 8 * (reg >> 1), 16 * block + r + 8 * (reg & 1)
        return (token, dim), (token + 1, dim)
    raise ValueError(f"kind must be {KEY!r} or {VALUE!r}, got {kind!r}")


def code_bit_index(kind: str, token, dim, bit, head_dim: int, where=None):
    """Bit index, inside one head's code block of a page, of bit ``bit`` (0..2) of the code of
    (``token``, ``dim``); byte ``i // 8``, bit ``i % 8``. Pure integer arithmetic (// % * + and
    ``where(cond, a, b)``), so the same function indexes Python ints, torch tensors and TileLang
    expressions. ``where`` defaults to a Python conditional."""
    if where is None:
        where = lambda cond, a, b: a if cond else b  # noqa: E731
    chunk, tc = token // CHUNK_TOKENS, token % CHUNK_TOKENS
    block, dd = dim // 16, dim % 16
    r, t, half, reg = _mma_slot(kind, tc, dd)
    pair = 4 * block + reg
    triple, q = pair // PAIRS_PER_TRIPLE, pair % PAIRS_PER_TRIPLE
    word0 = (chunk * LANES + 4 * r + t) * lane_words(head_dim) + TRIPLE_WORDS * triple
    spread = q == PAIRS_PER_TRIPLE - 1
    word = word0 + where(spread, bit, q // PAIRS_PER_WORD)
    bits = WORD_BITS[kind]
    slot = q % PAIRS_PER_WORD
    low = bits.low[-1]
    for i in range(PAIRS_PER_WORD - 2, -1, -1):  # bits.low[slot] as a chain of where()
        low = where(slot == i, bits.low[i], low)
    spare = bits.spare[0] + (bits.spare[1] - bits.spare[0]) * half
    pos = where(spread, spare, low + bits.high_offset * half + bit)
    return word * 32 + pos


def lane_word(kind: str, lane, triple, word: int, code):
    """uint32 word ``word`` (0..2) of triple ``triple`` of lane ``lane``'s stream of one chunk, built
    as the OR of the codes it holds: pairs 5*word .. 5*word+4 of the triple whole, and bit ``word`` of
    both codes of pair 15, where ``WORD_BITS[kind]`` puts them. ``code(token, dim)`` gives the code of
    a token of the chunk as an unsigned integer. Integer operators only, so ``lane``, ``triple`` and
    the codes may be ints, tensors or TileLang expressions (the FP8 -> TQ3 kernel packs with it); the
    inverse of ``code_bit_index``."""
    bits = WORD_BITS[kind]
    first = PAIRS_PER_TRIPLE * triple
    (t0, d0), (t1, d1) = pair_coords(kind, lane, first + PAIRS_PER_TRIPLE - 1)
    value = (((code(t0, d0) >> word) & 1) << bits.spare[0]) | (((code(t1, d1) >> word) & 1) << bits.spare[1])
    for i in range(PAIRS_PER_WORD):
        (t0, d0), (t1, d1) = pair_coords(kind, lane, first + PAIRS_PER_WORD * word + i)
        value = value | (code(t0, d0) << bits.low[i]) | (code(t1, d1) << (bits.low[i] + bits.high_offset))
    return value


def triple_codes(kind: str, words):
    """The 16 (low code, high code) of one triple, in pair order, from its three uint32 words
    ``words[0..2]``: the inverse of ``lane_word`` (pair ``q`` is pair ``16*triple + q`` of the lane,
    ``pair_coords`` places it). Integer operators only, so the words may be ints, tensors or TileLang
    expressions (the TQ3 -> FP8 kernel unpacks with it); every field is masked, so signed int32 words
    give the same codes."""
    bits = WORD_BITS[kind]
    mask = NUM_CODES - 1
    pairs = [
        ((words[k] >> low) & mask, (words[k] >> (low + bits.high_offset)) & mask)
        for k in range(TRIPLE_WORDS)
        for low in bits.low
    ]
    spare = []
    for s in bits.spare:  # pair 15: bit b of its low / high code is bit s of word b
        code = (words[0] >> s) & 1
        for b in range(1, TQ3_BITS):
            code = code | (((words[b] >> s) & 1) << b)
        spare.append(code)
    return pairs + [tuple(spare)]
