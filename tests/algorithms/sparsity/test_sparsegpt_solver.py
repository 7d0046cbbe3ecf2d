"""The SparseGPT solver against a plain float64 column-by-column reference, and its identities."""

from __future__ import annotations

import pytest
import torch

from layerwise.algorithms.hessian import HessianError
from layerwise.algorithms.sparsity.masks import MaskStructure, magnitude_mask, pruned_count
from layerwise.algorithms.sparsity.sparsegpt import sparsegpt_prune


def correlated_hessian(columns: int, tokens: int = 512, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(columns) + 2 * torch.randn(columns, columns, generator=g) / columns ** 0.5
    x = torch.randn(tokens, columns, generator=g) @ mix
    return 2 * x.t() @ x / tokens, x


def reference_prune(weight, hessian, structure, sparsity, block_size, dampening_frac=0.01):
    """SparseGPT written out plainly: float64, one column at a time, a full inverse."""
    W = weight.double().clone()
    H = hessian.double().clone()
    H += dampening_frac * H.diagonal().mean() * torch.eye(H.shape[0], dtype=H.dtype)
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    columns = W.shape[1]
    mask = torch.zeros_like(W, dtype=torch.bool)
    for start in range(0, columns, block_size):
        end = min(start + block_size, columns)
        if structure.unstructured:
            score = (W[:, start:end] / U.diagonal()[start:end]) ** 2
            k = pruned_count(score.numel(), sparsity)
            chosen = torch.zeros(score.numel(), dtype=torch.bool)
            chosen[torch.argsort(score.reshape(-1))[:k]] = True
            mask[:, start:end] = chosen.reshape(score.shape)
        for j in range(start, end):
            if structure.m and j % structure.m == 0:
                score = (W[:, j:j + structure.m] / U.diagonal()[j:j + structure.m]) ** 2
                drop = torch.argsort(score, dim=1)[:, :structure.n]
                mask[:, j:j + structure.m].scatter_(1, drop, True)
            error = W[:, j] * mask[:, j] / U[j, j]
            W[:, j:] -= error.unsqueeze(1) * U[j, j:].unsqueeze(0)
    return W, mask


@pytest.mark.parametrize("structure, block_size", [
    (MaskStructure(0, 0), 32), (MaskStructure(0, 0), 128), (MaskStructure(2, 4), 32), (MaskStructure(4, 8), 64),
])
def test_the_blocked_solver_equals_the_plain_column_by_column_reference(structure, block_size):
    hessian, _ = correlated_hessian(96)
    weight = torch.randn(24, 96, generator=torch.Generator().manual_seed(3))
    result = sparsegpt_prune(weight, hessian, structure, 0.5, block_size=block_size)
    expected, expected_mask = reference_prune(weight, hessian, structure, 0.5, block_size)
    assert torch.equal(result.mask, expected_mask)
    torch.testing.assert_close(result.weight.double(), expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(result.weight == 0, result.mask)  # zeros exactly where pruned, and only there


def test_with_an_identity_hessian_unstructured_sparsegpt_is_magnitude_pruning():
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    result = sparsegpt_prune(weight, torch.eye(64), MaskStructure(0, 0), 0.5, block_size=64)
    # one block: the half of the whole layer with the smallest |w|, nothing else changed
    threshold = weight.abs().reshape(-1).sort().values[weight.numel() // 2]
    assert torch.equal(result.mask, weight.abs() < threshold)
    assert torch.equal(result.weight, weight.masked_fill(result.mask, 0.0))


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4)])
def test_with_an_identity_hessian_n_m_sparsegpt_is_n_m_magnitude_pruning(n, m):
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(5))
    result = sparsegpt_prune(weight, torch.eye(64), MaskStructure(n, m), n / m, block_size=16)
    assert torch.equal(result.mask, magnitude_mask(weight, MaskStructure(n, m), n / m))
    assert torch.equal(result.weight, weight.masked_fill(result.mask, 0.0))


@pytest.mark.parametrize("sparsity", [0.0, 0.25, 0.5, 0.7])
def test_unstructured_layer_sparsity_is_exact(sparsity):
    hessian, _ = correlated_hessian(128)
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(6))
    result = sparsegpt_prune(weight, hessian, MaskStructure(0, 0), sparsity)
    assert int(result.mask.sum()) == pruned_count(weight.numel(), sparsity)


def test_compensation_lowers_the_output_error_below_magnitude_pruning():
    hessian, x = correlated_hessian(128, tokens=1024, seed=7)
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(8))
    for structure in (MaskStructure(0, 0), MaskStructure(2, 4)):
        pruned = sparsegpt_prune(weight, hessian, structure, 0.5).weight
        magnitude = weight.masked_fill(magnitude_mask(weight, structure, 0.5), 0.0)
        error = ((pruned - weight) @ x.t()).norm()
        assert error < ((magnitude - weight) @ x.t()).norm()


def test_dead_inputs_are_pruned_first_and_the_rest_still_solves():
    hessian, _ = correlated_hessian(32)
    hessian[5, :] = hessian[:, 5] = 0.0
    weight = torch.randn(8, 32, generator=torch.Generator().manual_seed(9))
    result = sparsegpt_prune(weight, hessian, MaskStructure(0, 0), 0.5)
    assert result.mask[:, 5].all() and torch.isfinite(result.weight).all()


def test_a_non_finite_hessian_is_an_error_the_caller_can_catch():
    hessian = torch.eye(8)
    hessian[1, 2] = float("nan")
    with pytest.raises(HessianError, match="non-finite"):
        sparsegpt_prune(torch.randn(4, 8), hessian, MaskStructure(0, 0), 0.5)
