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
        resolve_scheme("W5A16")
    assert all(name in str(info.value) for name in PRESETS)


def test_compressed_tensors_integer_names_are_presets_too():
    """A recipe written for llm-compressor names compressed-tensors' W<w>A<a> presets: groups of 128,
    symmetric, int inputs per token at run time (A16: none); INT8 is its other name for W8A8."""
    w3 = resolve_scheme("W3A16")
    assert (w3.weights.num_bits, w3.weights.group_size, w3.weights.symmetric, w3.input_activations) == (3, 128, True, None)
    w4a8 = resolve_scheme("W4A8")
    assert w4a8.weights.num_bits == 4 and w4a8.weights.strategy == "group"
    assert (w4a8.input_activations.num_bits, w4a8.input_activations.strategy, w4a8.input_activations.dynamic) == \
        (8, "token", True)
    assert resolve_scheme("W4A4").input_activations.num_bits == 4 and resolve_scheme("W2A16").weights.num_bits == 2
    assert resolve_scheme("INT8") == PRESETS["W8A8"]
    assert "W4A2" not in PRESETS and "W5A16" not in PRESETS  # narrower inputs than weights; 5 bits not packed


def test_a_compressed_tensors_scheme_object_is_read_as_its_mapping():
    ct = pytest.importorskip("compressed_tensors.quantization")
    scheme = ct.QuantizationScheme(targets=["Linear"], weights=ct.QuantizationArgs(num_bits=4, strategy="group",
                                                                                   group_size=64))
    assert resolve_scheme(scheme).weights.group_size == 64 and resolve_scheme(scheme).weights.num_bits == 4


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
