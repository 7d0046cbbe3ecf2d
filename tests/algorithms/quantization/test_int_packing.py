"""Our int32 packing against compressed-tensors' own (the reference: its loaders read this layout)."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32 as reference

from layerwise.algorithms.quantization.int_packing import pack_to_int32, packed_words, unpack_int4


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("packed_dim", [0, 1])
@pytest.mark.parametrize("shape", [(3, 64), (6, 64), (8, 1), (5, 37), (33, 7), (1, 1)])
def test_every_bit_width_packs_as_compressed_tensors_does(bits, packed_dim, shape):
    generator = torch.Generator().manual_seed(bits * 100 + shape[1])
    low, high = -(1 << (bits - 1)), (1 << (bits - 1))
    values = torch.randint(low, high, shape, generator=generator, dtype=torch.int8)
    values[0, 0], values[-1, -1] = low, high - 1  # both ends of the range
    ours, theirs = pack_to_int32(values, bits, packed_dim), reference(values, bits, packed_dim)
    assert ours.dtype == torch.int32 and torch.equal(ours, theirs)
    assert ours.shape[packed_dim] == packed_words(shape[packed_dim], bits)


def test_wrong_inputs_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="int8 values, got torch.int32"):
        pack_to_int32(torch.zeros(2, 8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="1 to 8 bits, got 9"):
        pack_to_int32(torch.zeros(2, 8, dtype=torch.int8), 9)



@pytest.mark.parametrize("shape", [(3, 64), (5, 37), (1, 1), (4, 8)])
def test_int4_words_unpack_to_their_values(shape):
    values = torch.randint(-8, 8, shape, generator=torch.Generator().manual_seed(shape[1]), dtype=torch.int8)
    values[0, 0] = -8
    assert torch.equal(unpack_int4(pack_to_int32(values, 4), shape[1]), values)
