"""Range observers: min-max, its moving average, and the MSE search, for weights and for activations."""

from __future__ import annotations

import pytest
import torch

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.presets import resolve_scheme
from layerwise.algorithms.quantization.qmath import fake_quantize_weight, weight_qparams
from layerwise.host.plugin_manager import registry

INT4_GROUPS = QuantizationArgs(num_bits=4, strategy="group", group_size=32)
FP8_BLOCKS = QuantizationArgs(type="float", num_bits=8, strategy="block", block_structure=(8, 32), group_size=None)
STATIC_INT8 = QuantizationArgs(num_bits=8, strategy="tensor", group_size=None)
#: the low-bit float formats' weight args (NVFP4's block scales relative to the tensor's global scale)
FLOAT_FORMATS = {name: resolve_scheme(name).weights for name in ("NVFP4A16", "MXFP4A16", "MXFP8A16")}


def observer(name, args):
    return registry("observers").get(name)(args)


def weight_errors(name, args, weight):
    """The squared quantization error of each element of ``weight`` with the ranges ``name`` observes."""
    scale, zero = weight_qparams(weight, args, observer(name, args))
    return (fake_quantize_weight(weight, scale, zero, args) - weight).pow(2)


def weight_error(name, args, weight):
    return weight_errors(name, args, weight).mean().item()


@pytest.mark.parametrize("args", [INT4_GROUPS, FP8_BLOCKS], ids=["int4-group", "fp8-block"])
def test_mse_never_quantizes_a_weight_worse_than_min_max(args):
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    weight[3, 5] = 9.0  # an outlier that stretches one group's range
    assert weight_error("mse", args, weight) < weight_error("minmax", args, weight)
    assert weight_error("moving_average_minmax", args, weight) == weight_error("minmax", args, weight)


@pytest.mark.parametrize("preset", list(FLOAT_FORMATS))
def test_mse_on_a_float_format_is_never_worse_than_min_max_in_any_block(preset):
    """The search tries min-max's own range first (shrink 1), so each block's error is at most min-max's, and
    NVFP4's block scales are searched relative to the weight's global scale (computed first, as min-max does)."""
    args = FLOAT_FORMATS[preset]
    weight = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    weight[3, 5] = 7.0  # an outlier (MX: past 6 * 1.75 / 2, so min-max doubles its block's step for it)
    blocks = {name: weight_errors(name, args, weight).reshape(16, -1, args.group_size).sum(dim=-1)
              for name in ("mse", "minmax")}
    assert bool((blocks["mse"] <= blocks["minmax"]).all())
    if args.num_bits == 4:  # FP4's few values gain from clipping; FP8's step is relative, its error barely moves
        assert blocks["mse"].sum() < blocks["minmax"].sum()


@pytest.mark.parametrize("modifier", ["QuantizationModifier", "GPTQModifier"])
@pytest.mark.parametrize("preset", ["NVFP4A16", "NVFP4"])
def test_mse_runs_on_nvfp4_with_round_to_nearest_and_gptq(preset, modifier):
    import layerwise
    from layerwise.testing import token_batches
    from tests.conftest import build_tiny_llama

    model = build_tiny_llama(hidden_size=64, intermediate_size=128)
    recipe = [{modifier: {"scheme": preset, "observer": "mse"}}]
    layerwise.compress(model, recipe, dataset=token_batches(16, 16, vocab=128), show_progress=False, device="cpu")
    assert model.model.layers[0].mlp.down_proj.weight_global_scale.numel() == 1


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
