"""The sparse layouts encode and decode exactly: every value back, bit for bit, any width and dtype."""

import numpy as np
import pytest
import torch

from layerwise.algorithms.sparsity.bitmask import (
    SparseFormatError,
    decode_bitmask,
    decode_sparse_24,
    encode_bitmask,
    encode_sparse_24,
    pack_bits,
    unpack_bits,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def bits_of(tensor):
    """The raw bits, so -0.0 and 0.0 (or two NaN payloads) are told apart."""
    return tensor.contiguous().view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


@pytest.mark.parametrize("cols", [1, 7, 8, 13, 67])
def test_bits_are_packed_as_numpy_packbits_little(cols):
    mask = torch.rand(5, cols, generator=gen(cols)) > 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and tuple(packed.shape) == (5, -(-cols // 8))
    assert np.array_equal(packed.numpy(), np.packbits(mask.numpy(), axis=1, bitorder="little"))
    assert torch.equal(unpack_bits(packed, cols), mask)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [13, 64, 67])
def test_bitmask_round_trip_is_exact(dtype, cols):
    weight = torch.randn(9, cols, generator=gen(cols)).to(dtype)
    weight[weight.abs() < 0.6] = 0
    weight[3] = 0  # an all-zero row
    weight[5] = torch.randn(cols, generator=gen(1)).to(dtype)  # a row with no zero
    parts = encode_bitmask(weight)
    nonzero = weight != 0
    assert parts["shape"].dtype == torch.int64 and parts["shape"].tolist() == [9, cols]
    assert parts["compressed"].dtype == dtype and parts["compressed"].tolist() == weight[nonzero].tolist()
    assert parts["bitmask"].dtype == torch.uint8 and tuple(parts["bitmask"].shape) == (9, -(-cols // 8))
    counts = nonzero.sum(1)
    assert parts["row_offsets"].dtype == torch.int32
    assert parts["row_offsets"].tolist() == (torch.cumsum(counts, 0) - counts).tolist()
    decoded = decode_bitmask(parts)
    assert decoded.dtype == dtype and torch.equal(bits_of(decoded), bits_of(weight))


@pytest.mark.parametrize("weight", [torch.zeros(3, 10), torch.ones(2, 9)], ids=["all-zero", "dense"])
def test_bitmask_of_the_extremes(weight):
    parts = encode_bitmask(weight)
    assert parts["compressed"].numel() == int((weight != 0).sum())
    assert torch.equal(decode_bitmask(parts), weight)


def test_bitmask_parts_that_disagree_are_refused():
    parts = encode_bitmask(torch.tensor([[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]]))
    with pytest.raises(SparseFormatError, match="compressed holds 2 values"):
        decode_bitmask({**parts, "compressed": parts["compressed"][:2]})
    with pytest.raises(SparseFormatError, match="row_offsets"):
        decode_bitmask({**parts, "row_offsets": torch.tensor([0, 1], dtype=torch.int32)})
    with pytest.raises(SparseFormatError, match=r"bitmask has shape \(1, 1\)"):
        decode_bitmask({**parts, "bitmask": parts["bitmask"][:1]})


def two_four(rows, cols, dtype, seed=0):
    """Random 2:4 weights, then some runs thinned to one nonzero or none."""
    weight = torch.randn(rows, cols, generator=gen(seed))
    runs = weight.view(rows, cols // 4, 4)
    drop = torch.rand(rows, cols // 4, 4, generator=gen(seed + 1)).argsort(-1)[..., :2]
    runs.scatter_(-1, drop, 0.0)
    weight[0, :4] = 0  # a run of zeros only
    weight[1, 4:8] = torch.tensor([0.0, 0.0, 0.0, 3.0])  # one nonzero, in the last column
    return weight.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_24_round_trip_is_exact(dtype):
    weight = two_four(6, 24, dtype)
    parts = encode_sparse_24(weight)
    assert set(parts) == {"shape", "compressed", "bitmask"}
    assert parts["compressed"].dtype == dtype and tuple(parts["compressed"].shape) == (6, 12)
    keep = unpack_bits(parts["bitmask"], 24).view(6, 6, 4)
    assert bool((keep.sum(-1) == 2).all())  # exactly 2 of every 4, zeros stored as values
    assert bool(keep.view(6, 24)[weight != 0].all())  # every nonzero kept
    assert parts["compressed"][0, :2].tolist() == [0.0, 0.0]
    assert parts["compressed"][1, 2:4].tolist() == [0.0, 3.0]  # kept values in column order
    assert keep[1, 1].tolist() == [True, False, False, True]  # the earliest zero fills the pair
    decoded = decode_sparse_24(parts)
    assert decoded.dtype == dtype and torch.equal(decoded, weight)


def test_sparse_24_needs_a_2_4_weight():
    weight = two_four(2, 8, torch.float32)
    weight[1, 4:8] = torch.tensor([1.0, 2.0, 0.0, 3.0])
    with pytest.raises(SparseFormatError, match=r"row 1, columns 4-7\), so the weight is not 2:4"):
        encode_sparse_24(weight)
    with pytest.raises(SparseFormatError, match="divisible by 4"):
        encode_sparse_24(torch.zeros(2, 6))


def test_sparse_24_bitmask_keeping_three_is_refused():
    parts = encode_sparse_24(two_four(2, 8, torch.float32))
    parts["bitmask"][0, 0] |= 4  # row 0's first run (zeros, kept at 0 and 1) keeps column 2 too
    with pytest.raises(SparseFormatError, match="exactly 2 positions"):
        decode_sparse_24(parts)
