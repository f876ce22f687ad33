"""FP8 and TQ3 page formats: rotation, codebook, pack/unpack, byte accounting. No sglang import."""

from .accounting import PageBytes, bytes_per_token_table, fp8_bits, fp8_bytes, tq3_bits, tq3_bytes
from .codebook import Codebook, key_codebook, tq3_codebook
from .fp8 import FP8_DTYPE, fp8_dequantize, fp8_quantize, fp8_requantize
from .layout import LSE_BASE, VALUE_CODES, TQ3PageLayout, fp8_page_bytes
from .packing import pack_codes, unpack_codes
from .rotation import LayerRotation, fwht
from .tq3 import (
    TQ3PageFields,
    decode_pages,
    dequantize_keys,
    dequantize_values,
    dequantize_values_lloyd_max,
    encode_pages,
    page_fields,
    quantize_keys,
    quantize_values,
    quantize_values_lloyd_max,
    sum_of_squares,
    to_original_space,
    value_codebook,
)

__all__ = [
    "FP8_DTYPE",
    "LSE_BASE",
    "VALUE_CODES",
    "Codebook",
    "LayerRotation",
    "PageBytes",
    "TQ3PageFields",
    "TQ3PageLayout",
    "bytes_per_token_table",
    "decode_pages",
    "dequantize_keys",
    "dequantize_values",
    "dequantize_values_lloyd_max",
    "encode_pages",
    "fp8_bits",
    "fp8_bytes",
    "fp8_dequantize",
    "fp8_page_bytes",
    "fp8_quantize",
    "fp8_requantize",
    "fwht",
    "key_codebook",
    "page_fields",
    "pack_codes",
    "quantize_keys",
    "quantize_values",
    "quantize_values_lloyd_max",
    "sum_of_squares",
    "to_original_space",
    "tq3_bits",
    "tq3_bytes",
    "tq3_codebook",
    "unpack_codes",
    "value_codebook",
]
