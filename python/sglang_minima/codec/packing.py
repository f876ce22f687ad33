"""Code packing of one head of one page, in the MMA order of layout.py ("Codes are stored..."): 3-bit
codes in 96-bit triples, 4-bit codes (keys with ``key_bits=4``, values with ``value_bits=4``) four
pairs a 32-bit word (``layout.code4_bit_index``)."""

from __future__ import annotations

import sys
from functools import lru_cache

import torch

from .layout import (
    KEY,
    NUM_CODES,
    TQ3_BITS,
    TRIPLE_WORDS,
    VALUE,
    WORD_BITS,
    TQ3PageLayout,
    code4_bit_index,
    code_bit_index,
)


@lru_cache(maxsize=32)
def _bit_index(
    kind: str, page_size: int, head_dim: int, device: torch.device, bits: int = TQ3_BITS
) -> torch.Tensor:
    """int64 [P, D, bits] on ``device``: the bit of a head's code block that holds each code bit
    (layout.code_bit_index; 4-bit codes: layout.code4_bit_index). Cached per device, so encoding on a
    GPU does not re-upload it."""
    token = torch.arange(page_size).view(-1, 1, 1)
    dim = torch.arange(head_dim).view(1, -1, 1)
    bit = torch.arange(bits).view(1, 1, -1)
    if bits == TQ3_BITS:
        index = code_bit_index(kind, token, dim, bit, head_dim, where=torch.where)
    else:
        index = code4_bit_index(kind, token, dim, bit, head_dim)
    return index.expand(page_size, head_dim, bits).contiguous().to(device)


def _check(kind: str, page_size: int, head_dim: int, device: torch.device, bits: int = TQ3_BITS) -> torch.Tensor:
    if kind not in (KEY, VALUE):
        raise ValueError(f"kind must be {KEY!r} or {VALUE!r}, got {kind!r}")
    TQ3PageLayout(1, page_size, head_dim, **{"key_bits" if kind == KEY else "value_bits": bits})  # geometry, width
    return _bit_index(kind, page_size, head_dim, device, bits)


def pack_codes(codes: torch.Tensor, kind: str, bits: int = TQ3_BITS) -> torch.Tensor:
    """uint8 codes in [0, 2**bits) [..., P, D] (one head of one page) -> uint8 [..., P*D*bits/8] in
    MMA order. ``bits``: 3 or 4 (``TQ3PageLayout.key_bits`` / ``value_bits``)."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_codes expects uint8 codes, got dtype={codes.dtype}")
    if codes.dim() < 2:
        raise ValueError(f"pack_codes expects codes [..., page_size, head_dim], got shape {tuple(codes.shape)}")
    p, d = codes.shape[-2:]
    index = _check(kind, p, d, codes.device, bits)
    if codes.numel() and int(codes.max()) >= 1 << bits:
        raise ValueError(f"pack_codes: {bits}-bit codes must be < {1 << bits}, got max {int(codes.max())}")
    lead = codes.shape[:-2]
    code_bits = (codes.unsqueeze(-1) >> torch.arange(bits, device=codes.device, dtype=torch.uint8)) & 1
    flat = torch.zeros(*lead, p * d * bits, dtype=torch.uint8, device=codes.device)
    flat.index_copy_(-1, index.reshape(-1), code_bits.reshape(*lead, -1))
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32)).view(1, 8)
    return (flat.view(*lead, -1, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


@lru_cache(maxsize=32)
def _code_reads(kind: str, page_size: int, head_dim: int, device: torch.device, bits: int = TQ3_BITS):
    """How to read each code of a head's block as 32-bit little-endian words: (word, shift) [P*D]
    of its lowest bit, and, for the codes whose bits are not adjacent in one word (the spread pair
    of each 3-bit triple; none for 4-bit codes), their flat positions with (word, shift) [bits, n] of
    each bit."""
    if sys.byteorder != "little":
        raise RuntimeError("unpack_codes reads the code blocks as little-endian 32-bit words")
    index = _bit_index(kind, page_size, head_dim, device, bits).view(-1, bits)
    low = index[:, 0]
    steps = torch.arange(bits, device=index.device)
    adjacent = (index == low.unsqueeze(1) + steps).all(1) & (low // 32 == (low + bits - 1) // 32)
    spread = torch.nonzero(~adjacent).flatten()
    spread_bits = index[spread].T  # [bits, n]
    return low // 32, (low % 32).to(torch.int32), spread, spread_bits // 32, (spread_bits % 32).to(torch.int32)


def unpack_codes(packed: torch.Tensor, kind: str, page_size: int, head_dim: int, bits: int = TQ3_BITS) -> torch.Tensor:
    """uint8 [..., P*D*bits/8] -> uint8 codes [..., P, D] (inverse of pack_codes)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_codes expects uint8 bytes, got dtype={packed.dtype}")
    _check(kind, page_size, head_dim, packed.device, bits)
    nbytes = page_size * head_dim * bits // 8
    if packed.shape[-1] != nbytes:
        raise ValueError(
            f"unpack_codes: page_size={page_size}, head_dim={head_dim} ({bits}-bit codes) pack into {nbytes} "
            f"bytes, got last dim {packed.shape[-1]}"
        )
    word, shift, spread, spread_word, spread_shift = _code_reads(kind, page_size, head_dim, packed.device, bits)
    # Bit i of the block is bit i % 32 of little-endian word i // 32 (nbytes is a multiple of 4).
    words = packed.contiguous().view(torch.int32)
    codes = (words[..., word] >> shift) & ((1 << bits) - 1)  # most codes: adjacent bits of one word
    if spread.numel():
        spread_codes = torch.zeros_like(codes[..., spread])
        for b in range(bits):
            spread_codes |= ((words[..., spread_word[b]] >> spread_shift[b]) & 1) << b
        codes[..., spread] = spread_codes
    return codes.to(torch.uint8).view(*packed.shape[:-1], page_size, head_dim)


def _spread_mask(kind: str) -> int:
    """Both spare bits of a word: the spare pair's codes have bit ``b`` at these bits of word ``b``.
    ``spread_words`` shifts word ``b``'s copy ``b`` bits up, so each code becomes three adjacent bits."""
    s0, s1 = WORD_BITS[kind].spare
    if not (s0 + TQ3_BITS <= s1 and s1 + TQ3_BITS <= 32):
        raise AssertionError(f"packing: the spare bits {WORD_BITS[kind].spare} of {kind!r} cannot be spread")
    return (1 << s0) | (1 << s1)


@lru_cache(maxsize=32)
def _spread_reads(kind: str, page_size: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(word, shift) [P*D] of each code of a head's block in (token, dim) order, reading the block's
    words followed by one spread word per triple (``code_ints``): three adjacent bits for every code."""
    index = _bit_index(kind, page_size, head_dim, "cpu").view(-1, TQ3_BITS)
    low = index[:, 0]
    word, shift = low // 32, low % 32
    adjacent = (index[:, 1] == low + 1) & (index[:, 2] == low + 2) & (low // 32 == (low + 2) // 32)
    triple = word // TRIPLE_WORDS
    spread = index - ((TRIPLE_WORDS * triple) * 32).unsqueeze(1)  # bit b of a spread code: word b, same bit
    expected = (torch.arange(TQ3_BITS) * 32).unsqueeze(0) + spread[:, :1]
    if not bool(torch.equal(spread[~adjacent], expected.expand_as(spread)[~adjacent])):
        raise AssertionError(f"packing: the non-adjacent codes of {kind!r} are not spread over a triple's words")
    num_words = page_size * head_dim * TQ3_BITS // 32
    word = torch.where(adjacent, word, num_words + triple)
    return word.to(device), shift.to(torch.int32).to(device)


def code_ints(words: torch.Tensor, kind: str, page_size: int, head_dim: int) -> torch.Tensor:
    """int32 words [..., P*D*3/32] of head code blocks (their little-endian bytes) -> int32 codes
    [..., P*D] in (token, dim) order: the codes of ``unpack_codes``, in a handful of long ops (the
    CPU fast path). Each triple gets a spread word (its three words' spare bits, word ``b``'s moved
    ``b`` bits up), after which every code is three adjacent bits of one word: one gather of words,
    one shift, one mask."""
    if words.dtype != torch.int32:
        raise TypeError(f"code_ints expects int32 words, got dtype={words.dtype}")
    _check(kind, page_size, head_dim, words.device)
    if sys.byteorder != "little":
        raise RuntimeError("code_ints reads the code blocks as little-endian 32-bit words")
    lead, n = words.shape[:-1], words.shape[-1]
    if n != page_size * head_dim * TQ3_BITS // 32:
        raise ValueError(f"code_ints: page_size={page_size}, head_dim={head_dim} need {page_size * head_dim * TQ3_BITS // 32} words, got {n}")
    mask = _spread_mask(kind)
    w = words.reshape(-1, n // TRIPLE_WORDS, TRIPLE_WORDS)
    spread = (w[..., 0] & mask) | ((w[..., 1] & mask) << 1) | ((w[..., 2] & mask) << 2)
    ext = torch.cat([w.view(w.shape[0], n), spread], dim=1)
    reads, shift = _block_reads(kind, page_size, head_dim, words.device, _rows_bucket(ext.shape[0]))
    # (sizes spelled out: -1 is ambiguous for zero blocks)
    codes = ext.view(-1).index_select(0, reads[: ext.shape[0]].view(-1)).view(ext.shape[0], page_size * head_dim)
    return codes.bitwise_right_shift_(shift).bitwise_and_(NUM_CODES - 1).view(*lead, page_size * head_dim)


def value_code_ints(words: torch.Tensor, page_size: int, head_dim: int, value_bits: int = TQ3_BITS) -> torch.Tensor:
    """int32 words [..., P*D*value_bits/32] of value code blocks -> int32 codes [..., P*D], (token, dim)
    order: 3-bit values through ``code_ints``' spread words, 4-bit codes (each four adjacent bits of one
    word) through ``unpack_codes``."""
    if value_bits == TQ3_BITS:
        return code_ints(words, VALUE, page_size, head_dim)
    codes = unpack_codes(words.view(torch.uint8), VALUE, page_size, head_dim, value_bits)
    return codes.view(*words.shape[:-1], page_size * head_dim).to(torch.int32)


def _rows_bucket(rows: int) -> int:
    """Blocks per cached read index: the next power of two (a few cached sizes serve every tile)."""
    return 1 << max(rows - 1, 0).bit_length()


@lru_cache(maxsize=32)
def _block_reads(kind: str, page_size: int, head_dim: int, device: torch.device, rows: int):
    """(int32 word of each code of ``rows`` consecutive extended blocks [rows, P*D], shift [P*D])."""
    word, shift = _spread_reads(kind, page_size, head_dim, device)
    ext_words = page_size * head_dim * TQ3_BITS // 32 * (TRIPLE_WORDS + 1) // TRIPLE_WORDS
    base = torch.arange(rows, device=device, dtype=torch.int64).view(-1, 1) * ext_words
    return (base + word).to(torch.int32), shift


@lru_cache(maxsize=32)
def _key_field_reads(page_size: int, head_dim: int, device: torch.device, rows: int):
    """(int32 word [rows, P*D/2], shift [P*D/2]) of each key pair field (dims 2j, 2j+1 of a token) of
    ``rows`` consecutive extended blocks (``key_pair_fields``)."""
    bits = WORD_BITS[KEY]
    if bits.high_offset != TQ3_BITS:
        raise AssertionError(f"packing: key pairs are not 6-bit fields ({bits})")
    index = _bit_index(KEY, page_size, head_dim, "cpu").view(page_size, head_dim // 2, 2, TQ3_BITS)
    low, high = index[:, :, 0, 0], index[:, :, 1, 0]
    adjacent = (high == low + TQ3_BITS) & (low // 32 == (low + 2 * TQ3_BITS - 1) // 32)
    spread = (low // 32) % TRIPLE_WORDS == 0  # a spread pair's low code starts in its triple's word 0
    if not bool((adjacent | spread).all()):
        raise AssertionError("packing: a key pair is neither one 6-bit field nor the spare pair")
    num_words = page_size * head_dim * TQ3_BITS // 32
    word = torch.where(adjacent, low // 32, num_words + low // 32 // TRIPLE_WORDS).flatten()
    shift = torch.where(adjacent, low % 32, 0).flatten().to(torch.int32)
    ext_words = num_words * (TRIPLE_WORDS + 1) // TRIPLE_WORDS
    base = torch.arange(rows, dtype=torch.int64).view(-1, 1) * ext_words
    return (base + word).to(torch.int32).to(device), shift.to(device)


@lru_cache(maxsize=32)
def _key4_byte_reads(page_size: int, head_dim: int, device: torch.device, rows: int) -> torch.Tensor:
    """int32 [rows, P*D/2]: the byte of ``rows`` consecutive 4-bit key blocks holding each pair field
    (token, dims 2j and 2j+1), in (token, j) order."""
    index = _bit_index(KEY, page_size, head_dim, "cpu", 4).view(page_size, head_dim // 2, 2, 4)
    byte = (index[:, :, 0, 0] // 8).flatten()
    if not bool(torch.equal(index[:, :, 1, 0], index[:, :, 0, 0] + 4)):
        raise AssertionError("packing: a 4-bit key pair is not one byte (low nibble, high nibble)")
    base = torch.arange(rows, dtype=torch.int64).view(-1, 1) * (page_size * head_dim // 2)
    return (base + byte).to(torch.int32).to(device)


def key_pair_fields(words: torch.Tensor, page_size: int, head_dim: int, key_bits: int = TQ3_BITS) -> torch.Tensor:
    """int32 words [..., P*D*key_bits/32] of key code blocks -> int32 [..., P*D/2]: for each token
    and each dim pair (2j, 2j+1), the field ``code(2j) | code(2j+1) << key_bits`` (the keys' pair, one
    index into a table of 2**(2*key_bits) centroid pairs). 3-bit keys: each triple gets one extra
    word holding the spare pair's field, so every field is one shift and one mask of one word; 4-bit
    keys: each field is one byte of the block, gathered in (token, dim) order."""
    if words.dtype != torch.int32:
        raise TypeError(f"key_pair_fields expects int32 words, got dtype={words.dtype}")
    _check(KEY, page_size, head_dim, words.device, key_bits)
    lead, n = words.shape[:-1], words.shape[-1]
    if n != page_size * head_dim * key_bits // 32:
        raise ValueError(
            f"key_pair_fields: page_size={page_size}, head_dim={head_dim} need "
            f"{page_size * head_dim * key_bits // 32} words of {key_bits}-bit keys, got {n}"
        )
    if key_bits != TQ3_BITS:
        if sys.byteorder != "little":
            raise RuntimeError("key_pair_fields reads the code blocks as little-endian 32-bit words")
        blocks = words.reshape(-1, n).view(torch.uint8)  # [rows, P*D/2]: one byte per pair
        reads = _key4_byte_reads(page_size, head_dim, words.device, _rows_bucket(blocks.shape[0]))
        fields = blocks.reshape(-1).index_select(0, reads[: blocks.shape[0]].view(-1))
        return fields.to(torch.int32).view(*lead, page_size * head_dim // 2)
    s0, s1 = WORD_BITS[KEY].spare
    mask = _spread_mask(KEY)
    w = words.reshape(-1, n // TRIPLE_WORDS, TRIPLE_WORDS)
    spread = (w[..., 0] & mask) | ((w[..., 1] & mask) << 1) | ((w[..., 2] & mask) << 2)
    field = ((spread >> s0) & (NUM_CODES - 1)) | (((spread >> s1) & (NUM_CODES - 1)) << TQ3_BITS)
    ext = torch.cat([w.view(w.shape[0], n), field], dim=1)
    reads, shift = _key_field_reads(page_size, head_dim, words.device, _rows_bucket(ext.shape[0]))
    fields = ext.view(-1).index_select(0, reads[: ext.shape[0]].view(-1)).view(ext.shape[0], page_size * head_dim // 2)
    return fields.bitwise_right_shift_(shift).bitwise_and_((1 << 2 * TQ3_BITS) - 1).view(*lead, page_size * head_dim // 2)
