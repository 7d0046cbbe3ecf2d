"""Sylvester Hadamards and the fast Walsh-Hadamard transform, against the explicit matrix product."""

from __future__ import annotations

import math

import pytest
import torch

from layerwise.algorithms.quantization.hadamard import (
    HadamardSizeError,
    check_block,
    fwht,
    hadamard_matrix,
    known_hadamard,
    largest_power_of_two_dividing,
)


@pytest.mark.parametrize("n", [1, 2, 8, 64, 1024])
def test_sylvester_matrix_is_hadamard_and_symmetric(n):
    h = hadamard_matrix(n)
    assert set(h.unique().tolist()) <= {-1.0, 1.0}
    torch.testing.assert_close(h @ h.t(), n * torch.eye(n, dtype=torch.float64), rtol=0, atol=0)
    assert torch.equal(h, h.t())
    if n >= 2:  # the doubling that defines it
        half = hadamard_matrix(n // 2)
        assert torch.equal(h, torch.cat([torch.cat([half, half], 1), torch.cat([half, -half], 1)], 0))


@pytest.mark.parametrize("n", [2, 64, 1024])
def test_equals_compressed_tensors_deterministic_hadamard(n):
    from compressed_tensors.transform.utils.hadamard import deterministic_hadamard_matrix

    assert torch.equal(hadamard_matrix(n), deterministic_hadamard_matrix(n, torch.float64))


@pytest.mark.parametrize("n,block", [(8, None), (1024, None), (384, 128), (384, 64), (96, 32)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_fwht_equals_the_matrix_product(n, block, dtype):
    x = torch.randn(3, 5, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    size = block or n
    full = torch.block_diag(*[hadamard_matrix(size)] * (n // size)) / math.sqrt(size)
    expected = x @ full
    given = x.to(dtype)
    kept = given.clone()
    got = fwht(given, block)
    assert torch.equal(given, kept)  # the input is never written
    torch.testing.assert_close(fwht(given.transpose(0, 1), block), got.transpose(0, 1), rtol=0, atol=0)
    assert got.dtype == dtype and got.shape == x.shape
    tolerance = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(fwht(fwht(x, block), block), x, rtol=1e-12, atol=1e-12)  # H / sqrt(n) is its own inverse


def test_sizes_without_a_sylvester_hadamard_are_named_with_a_block_that_works():
    with pytest.raises(HadamardSizeError, match="set the block size to 256"):
        fwht(torch.zeros(2, 11008))
    with pytest.raises(HadamardSizeError, match="does not divide the width 96"):
        check_block(96, 64)
    with pytest.raises(HadamardSizeError, match="power-of-two order only"):
        hadamard_matrix(12)
    assert largest_power_of_two_dividing(11008) == 256 and check_block(11008, 256) == 256


@pytest.mark.parametrize("n", [1, 4, 12, 96, 384, 768, 1024, 2560, 172 * 8])
@pytest.mark.parametrize("seed", [0, 5])
def test_residual_hadamard_is_compressed_tensors_random_hadamard_bit_for_bit(n, seed):
    from compressed_tensors.transform.utils.hadamard import random_hadamard_matrix

    from layerwise.algorithms.quantization.rotation import rotation_matrix

    expected = random_hadamard_matrix(n, torch.float64, torch.device("cpu"), torch.Generator().manual_seed(seed))
    assert torch.equal(rotation_matrix(n, "hadamard", seed), expected / math.sqrt(n))
    h = known_hadamard(n)
    assert torch.equal(h @ h.t(), n * torch.eye(n, dtype=torch.float64))


def test_known_hadamards_are_read_without_importing_compressed_tensors():
    import subprocess
    import sys

    code = ("import sys; from layerwise.algorithms.quantization.rotation import rotation_matrix; "
            "rotation_matrix(384, 'hadamard', 0); assert 'compressed_tensors' not in sys.modules, 'imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
    with pytest.raises(HadamardSizeError, match="order 260"):
        known_hadamard(260)
