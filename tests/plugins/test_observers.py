"""Range observers: min-max, its moving average, and the MSE search, for weights and for activations."""

from __future__ import annotations

import pytest
import torch

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import compute_qparams, fake_quantize_weight
from layerwise.host.plugin_manager import registry

INT4_GROUPS = QuantizationArgs(num_bits=4, strategy="group", group_size=32)
FP8_BLOCKS = QuantizationArgs(type="float", num_bits=8, strategy="block", block_structure=(8, 32), group_size=None)
STATIC_INT8 = QuantizationArgs(num_bits=8, strategy="tensor", group_size=None)


def observer(name, args):
    return registry("observers").get(name)(args)


def weight_error(name, args, weight):
    scale, zero = compute_qparams(*observer(name, args)(weight), args)
    return (fake_quantize_weight(weight, scale, zero, args) - weight).pow(2).mean().item()


@pytest.mark.parametrize("args", [INT4_GROUPS, FP8_BLOCKS], ids=["int4-group", "fp8-block"])
def test_mse_never_quantizes_a_weight_worse_than_min_max(args):
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    weight[3, 5] = 9.0  # an outlier that stretches one group's range
    assert weight_error("mse", args, weight) < weight_error("minmax", args, weight)
    assert weight_error("moving_average_minmax", args, weight) == weight_error("minmax", args, weight)


def test_activation_ranges_widest_averaged_and_searched():
    batches = [torch.full((2, 8), 1.0), torch.full((2, 8), 3.0), torch.full((2, 8), -2.0)]
    seen = {name: observer(name, STATIC_INT8) for name in ("minmax", "moving_average_minmax")}
    for x in batches:
        for obs in seen.values():
            obs.update(x)
    assert [float(v) for v in seen["minmax"].result()] == [-2.0, 3.0]
    # each batch is constant, so its min and max are equal: 1 -> 1 + 0.01 (3 - 1) -> then 0.01 toward -2
    low, high = seen["moving_average_minmax"].result()
    assert float(low) == float(high) == pytest.approx(1.02 + 0.01 * (-2.0 - 1.02))
    with pytest.raises(ValueError, match="saw no calibration data"):
        observer("mse", STATIC_INT8).result()


def test_a_recipe_picks_the_input_observer():
    import layerwise
    from layerwise.plugins.modifiers.quantization import QuantizationModifier
    from layerwise.testing import token_batches
    from tests.conftest import build_tiny_llama

    scales = {}
    for name in ("minmax", "mse"):
        model = build_tiny_llama()
        scheme = {"preset": "W8A8_STATIC", "input_activations": {"observer": name}}
        layerwise.compress(model, [QuantizationModifier(scheme=scheme)], dataset=token_batches(2, 16, vocab=128),
                           show_progress=False, device="cpu")
        scales[name] = float(model.model.layers[0].mlp.down_proj.input_scale)
    assert scales["mse"] < scales["minmax"]  # the search clips the range
