"""Integer weights packed as compressed-tensors' ``pack-quantized`` format stores them.

compressed-tensors packs ``num_bits``-bit integers densely into int32 words along each row: element
``i`` of a row, offset to unsigned (``q + 2**(num_bits - 1)``), sits at bits ``num_bits * i`` onwards.
For 4 bits that is eight values a word, two a byte, the even column in the low nibble: the bytes of
the row's nibble pairs read as little-endian int32 words. Building those bytes takes three passes over
the weight; compressed-tensors' general packer (any bit width, values split across words) takes a
scatter over int32 copies, 3-4x longer on a large weight on the CPU. Other widths use its packer.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

from layerwise.algorithms.quantization.slices import by_row_slices


def pack_int(q: Tensor, num_bits: int) -> Tensor:
    """``(rows, columns)`` integers (any dtype, within the signed ``num_bits`` range) as compressed-tensors'
    ``pack_to_int32(q.to(int8), num_bits)`` packs them (int32, ``(rows, ceil(columns * num_bits / 32))``)."""
    if num_bits == 4 and q.ndim == 2 and q.shape[1] % 8 == 0 and sys.byteorder == "little":
        return by_row_slices(_pack_int4_rows, q)
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    return pack_to_int32(q.to(torch.int8), num_bits)


def _pack_int4_rows(q: Tensor) -> Tensor:
    nibbles = (q + 8).to(torch.uint8)  # -8..7 -> 0..15
    pairs = nibbles.reshape(q.shape[0], -1, 2)
    return (pairs[..., 0] | (pairs[..., 1] << 4)).contiguous().view(torch.int32)
