import pytest

from layerwise.algorithms.quantization.args import QuantizationArgs, QuantizationScheme
from layerwise.algorithms.quantization.presets import PRESETS, resolve_scheme
from layerwise.errors import RecipeError, UnknownNameError


def test_presets():
    assert PRESETS["W4A16"].weights == QuantizationArgs(4, True, "group", 128)
    assert PRESETS["W4A16_ASYM"].weights == QuantizationArgs(4, False, "group", 128)
    assert PRESETS["W8A16"].weights == QuantizationArgs(8, True, "channel", None)
    assert all(s.targets == ("Linear",) for s in PRESETS.values())


def test_unknown_preset_lists_valid_ones():
    with pytest.raises(UnknownNameError) as info:
        resolve_scheme("W3A16")
    assert all(name in str(info.value) for name in PRESETS)


def test_mapping_forms():
    assert resolve_scheme({"num_bits": 8, "strategy": "channel"}).weights == PRESETS["W8A16"].weights
    scheme = resolve_scheme({"weights": {"num_bits": 4, "group_size": 64}, "targets": ["re:.*mlp.*"]})
    assert scheme.weights.group_size == 64 and scheme.targets == ("re:.*mlp.*",)
    assert resolve_scheme({"preset": "W4A16", "strategy": "channel"}).weights.group_size is None
    assert resolve_scheme(PRESETS["W8A16"]) is PRESETS["W8A16"]
    assert isinstance(resolve_scheme("w8a16"), QuantizationScheme)


def test_unknown_field_lists_valid_ones():
    with pytest.raises(RecipeError, match="'bits'.*valid fields: num_bits, symmetric, strategy, group_size"):
        resolve_scheme({"bits": 4})
    with pytest.raises(RecipeError, match="'extra'.*valid fields: weights, targets"):
        resolve_scheme({"weights": {"num_bits": 4}, "extra": 1})
