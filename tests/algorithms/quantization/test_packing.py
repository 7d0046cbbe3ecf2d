"""pack_int against compressed-tensors' own packer: the same int32 words for the same integers."""

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

from layerwise.algorithms.quantization import slices
from layerwise.algorithms.quantization.packing import pack_int


@pytest.mark.parametrize("slice_elements", [1 << 16, 16])  # whole, or the CPU's slices of rows
@pytest.mark.parametrize(("bits", "shape"), [(4, (8, 64)), (4, (3, 8)), (4, (5, 12)), (2, (4, 32)), (3, (4, 32)),
                                              (8, (2, 16))])
def test_packed_words_equal_compressed_tensors(bits, shape, slice_elements, monkeypatch):
    monkeypatch.setattr(slices, "SLICE_ELEMENTS", slice_elements)
    low, high = -(2 ** (bits - 1)), 2 ** (bits - 1)
    q = torch.randint(low, high, shape, generator=torch.Generator().manual_seed(bits))
    q[0, :2] = torch.tensor([low, high - 1])  # both ends of the range
    got = pack_int(q.to(torch.float32), bits)  # the saver hands over float integers
    want = pack_to_int32(q.to(torch.int8), bits)
    assert got.dtype == torch.int32 and torch.equal(got, want)
