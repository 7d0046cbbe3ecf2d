"""AWQ's scale search as pure functions: s = 1 is the baseline, ties keep it, groups normalise weights."""

from __future__ import annotations

import torch

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.awq import (
    candidate_scales,
    output_loss,
    search_scales,
    weight_mean,
)

ARGS = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=8)


def sample(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 16, generator=g)
    x[:, 3] *= 20  # one outlier input channel
    return x, [torch.randn(12, 16, generator=g), torch.randn(4, 16, generator=g)]


def test_alpha_zero_without_duo_scaling_is_round_to_nearest_and_a_tie_keeps_it():
    x, weights = sample()
    result = search_scales(x, x.abs().mean(0), weights, ARGS, n_grid=1, duo_scaling=False)
    assert result.alpha is None and torch.equal(result.scales, torch.ones(16))
    assert result.losses == (result.rtn_loss,) and result.loss == result.rtn_loss


def test_the_chosen_loss_is_the_least_of_the_grid_and_below_round_to_nearest():
    x, weights = sample()
    result = search_scales(x, x.abs().mean(0), weights, ARGS, n_grid=10)
    assert result.alpha is not None and result.loss == min(result.losses) < result.rtn_loss
    assert result.loss == output_loss(x, weights, result.scales, ARGS)


def test_candidates_straddle_one_and_weights_are_measured_per_quantization_group():
    scales = candidate_scales(torch.tensor([1.0, 4.0, 16.0]), None, 0.5)
    torch.testing.assert_close(scales, torch.tensor([0.5, 1.0, 2.0]))
    weight = torch.tensor([[1.0, -2.0, 4.0, 8.0]])
    group = QuantizationArgs(num_bits=4, symmetric=False, strategy="group", group_size=2)
    torch.testing.assert_close(weight_mean([weight], group), torch.tensor([0.5, 1.0, 0.5, 1.0]))
    channel = QuantizationArgs(num_bits=4, symmetric=False, strategy="channel", group_size=None)
    torch.testing.assert_close(weight_mean([weight, 2 * weight], channel), torch.tensor([0.125, 0.25, 0.5, 1.0]))
