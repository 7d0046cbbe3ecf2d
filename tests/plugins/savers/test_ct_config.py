"""The saver's quantization_config dicts equal compressed-tensors' own dump of the same arguments."""

import dataclasses

import pytest
from compressed_tensors.quantization import QuantizationArgs as CTArgs
from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

from layerwise.algorithms.quantization.kv_cache import kv_cache_args
from layerwise.algorithms.quantization.presets import PRESETS
from layerwise.plugins.savers.compressed_tensors import _ct_args
from layerwise.plugins.savers.ct_config import args_json, config_json, scheme_json


def _variants():
    for name, scheme in PRESETS.items():
        yield f"{name}.weights", scheme.weights
        if scheme.input_activations is not None:
            yield f"{name}.inputs", scheme.input_activations
    w4 = PRESETS["W4A16"].weights
    yield "asymmetric channel", dataclasses.replace(w4, symmetric=False, strategy="channel", group_size=None)
    yield "actorder static", dataclasses.replace(w4, actorder="static")
    yield "int8 asymmetric tensor", dataclasses.replace(PRESETS["W8A16"].weights, symmetric=False, strategy="tensor")
    yield "static asymmetric inputs", dataclasses.replace(PRESETS["W8A8_STATIC"].input_activations, symmetric=False)
    yield "kv fp8", kv_cache_args("fp8")
    yield "kv fp8 per head", kv_cache_args("fp8_head")


@pytest.mark.parametrize(("name", "args"), list(_variants()), ids=[name for name, _ in _variants()])
def test_args_are_compressed_tensors_dump(name, args):
    fields = _ct_args(args)
    assert args_json(fields) == CTArgs(**fields).model_dump(mode="json")


@pytest.mark.parametrize("preset", ["W4A16", "W4AFP8", "NVFP4", "FP8_BLOCK", "W8A8_STATIC"])
def test_schemes_and_config_are_compressed_tensors_dump(preset):
    weights, inputs = PRESETS[preset].weights, PRESETS[preset].input_activations
    ours = {"group_0": scheme_json(["Linear"], args_json(_ct_args(weights)),
                                   None if inputs is None else args_json(_ct_args(inputs)), "pack-quantized"),
            "group_1": scheme_json(["re:^lm_head$"], args_json(_ct_args(weights)), None),
            "group_2": scheme_json(["LlamaAttention"], None, args_json(_ct_args(PRESETS["FP8"].input_activations)))}
    theirs = {"group_0": QuantizationScheme(targets=["Linear"], weights=CTArgs(**_ct_args(weights)),
                                            input_activations=None if inputs is None else CTArgs(**_ct_args(inputs)),
                                            output_activations=None, format="pack-quantized"),
              "group_1": QuantizationScheme(targets=["re:^lm_head$"], weights=CTArgs(**_ct_args(weights)),
                                            input_activations=None, output_activations=None, format=None),
              "group_2": QuantizationScheme(targets=["LlamaAttention"],
                                            input_activations=CTArgs(**_ct_args(PRESETS["FP8"].input_activations)))}
    for name, scheme in theirs.items():
        assert ours[name] == scheme.model_dump(mode="json")
    config = QuantizationConfig(config_groups=theirs, format="mixed-precision", quantization_status="compressed",
                                ignore=["lm_head", "model.embed"])
    assert config_json(ours, "mixed-precision", ["lm_head", "model.embed"]) == config.model_dump(mode="json")
