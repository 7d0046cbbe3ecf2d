"""Every preset's and every pruning recipe's output loads with plain ``AutoModelForCausalLM.from_pretrained``
(no option, no layerwise) to the in-memory model's outputs, and, where the weights were quantized, to its
dequantized weights.

Tolerances: logits within ``1e-5 * max|logits|`` (absolute, rtol 0); quantized weights within ``1e-6``
absolute. Measured on transformers 5.24.0 + compressed-tensors 0.20.0 (CPU, float32): every case below
matches exactly (difference 0.0); the slack is for other BLAS builds.

bfloat16 models with quantized integer or FP8 inputs: compressed-tensors quantizes the inputs in bfloat16,
and so does layerwise for a bfloat16 input; the reload's logits are the in-memory model's exactly.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization.storage import quantized_modules
from layerwise.algorithms.sparsity import sparse_modules
from layerwise.algorithms.sparsity.storage import PRUNED_ONLY_KEY
from layerwise.testing import token_batches
from tests.conftest import build_tiny_llama

BATCHES = token_batches(4, 16, vocab=128)

PRESETS = ["W4A16", "W4A16_ASYM", "W8A16", "W8A8", "W8A8_STATIC", "FP8_DYNAMIC", "FP8", "FP8_BLOCK", "W4AFP8"]
#: the calibrated algorithms, one preset each (GPTQ with and without quantized inputs, AWQ's asymmetric
#: default, SmoothQuant before GPTQ, GPTQ onto the float8 grid)
CALIBRATED = ["GPTQ_W4A16", "GPTQ_W8A8", "AWQ_W4A16_ASYM", "SQ_GPTQ_W8A8", "GPTQ_FP8_DYNAMIC"]
SPARSEGPT_24 = {"SparseGPTModifier": {"mask_structure": "2:4", "ignore": ["lm_head"]}}
SPARSEGPT_50 = {"SparseGPTModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}}
WANDA_24 = {"WandaModifier": {"mask_structure": "2:4", "ignore": ["lm_head"]}}
WANDA_50 = {"WandaModifier": {"sparsity": 0.5, "ignore": ["lm_head"]}}
PRUNING = {
    "sparsegpt-2of4": [SPARSEGPT_24],
    "sparsegpt-50pct": [SPARSEGPT_50],
    "wanda-2of4": [WANDA_24],
    "wanda-50pct": [WANDA_50],
    "sparsegpt-2of4+gptq-w4a16": [SPARSEGPT_24, {"GPTQModifier": {"scheme": "W4A16", "ignore": ["lm_head"]}}],
    "sparsegpt-50pct+w8a8": [SPARSEGPT_50, {"QuantizationModifier": {"scheme": "W8A8"}}],
    "wanda-2of4+fp8-dynamic": [WANDA_24, {"QuantizationModifier": {"scheme": "FP8_DYNAMIC"}}],
    "wanda-50pct+w4a16-asym": [WANDA_50, {"QuantizationModifier": {"scheme": "W4A16_ASYM"}}],
}


def compressed(recipe, out):
    # widths that are multiples of 128: W4A16's groups of 128, FP8_BLOCK's 128 x 128 tiles
    model = build_tiny_llama(hidden_size=128, intermediate_size=256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layerwise.compress(model, recipe, dataset=BATCHES, output_dir=out, show_progress=False)
    return model


def logits(model):
    with torch.no_grad():
        return model(**BATCHES[1]).logits


def check_plain_load(model, out):
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()  # nothing but the folder
    expected, got = logits(model), logits(reloaded)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    for name, module in quantized_modules(model).items():  # after a forward every layer is decompressed
        torch.testing.assert_close(reloaded.get_submodule(name).weight.to(torch.float32),
                                   module.weight.to(torch.float32), rtol=0, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    return reloaded


@pytest.mark.parametrize("preset", PRESETS + CALIBRATED)
def test_every_preset_loads_in_plain_transformers(preset, tmp_path):
    model = compressed(preset, tmp_path / "out")
    assert quantized_modules(model)
    check_plain_load(model, tmp_path / "out")


def test_packed_asymmetric_outputs_keep_vllm_s_zero_point_layout_and_say_dequantize(tmp_path):
    # transformers' packed path expects an unpacked (out, groups) zero point yet decompresses it as packed,
    # so the vLLM layout (ceil(out * bits / 32), groups) int32 stays, and the config picks transformers'
    # dequantize-on-load path, which decodes it
    from safetensors.torch import load_file

    model = compressed("W4A16_ASYM", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["dequantize"] is True and config["format"] == "pack-quantized"
    tensors = load_file(tmp_path / "out" / "model.safetensors")
    zero_point = tensors["model.layers.0.mlp.down_proj.weight_zero_point"]
    out_features, in_features = model.model.layers[0].mlp.down_proj.weight.shape
    assert zero_point.dtype == torch.int32 and tuple(zero_point.shape) == (out_features * 4 // 32, in_features // 128)
    symmetric = compressed("W4A16", tmp_path / "symmetric")
    assert "dequantize" not in json.loads((tmp_path / "symmetric" / "config.json").read_text())["quantization_config"]
    assert quantized_modules(symmetric)


@pytest.mark.parametrize("name", list(PRUNING))
def test_every_pruning_recipe_loads_in_plain_transformers(name, tmp_path):
    model = compressed(PRUNING[name], tmp_path / "out")
    pruned = sparse_modules(model)
    assert pruned
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    if quantized_modules(model):
        sparsity = config["quantization_config"]["sparsity_config"]
    else:  # a dense model to every loader, as compressed-tensors 0.19 writes it
        assert "quantization_config" not in config
        sparsity = config[PRUNED_ONLY_KEY]
    assert sparsity["format"] == "dense" and sparsity["targets"] == list(pruned)
    reloaded = check_plain_load(model, tmp_path / "out")
    for layer, module in pruned.items():  # the zeros are the pruned ones
        assert torch.equal(reloaded.get_submodule(layer).weight == 0, module.weight == 0), layer


#: quantized inputs on the integer and FP8 grids: per token (dynamic int8, FP8) and per tensor (static)
INPUT_QUANTIZED = ["W4AFP8", "FP8_DYNAMIC", "W8A8", "FP8", "W8A8_STATIC"]


def bfloat16_llama():
    """A bfloat16 tiny Llama as a loader builds one: ``.to()`` would round the rotary frequencies, which
    ``from_pretrained(dtype=torch.bfloat16)`` keeps in float32."""
    model = build_tiny_llama(hidden_size=128, intermediate_size=256)
    frequencies = {name: buffer for name, buffer in model.named_buffers() if name.endswith("inv_freq")}
    model = model.to(torch.bfloat16)
    for name, buffer in frequencies.items():
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, buffer)
    return model


@pytest.mark.parametrize("preset", INPUT_QUANTIZED)
def test_a_bfloat16_model_with_quantized_inputs_reloads_to_its_own_logits(preset, tmp_path):
    """compressed-tensors quantizes a layer's input in the model's dtype (range, scale, quotient, product each
    rounded to bfloat16); layerwise quantizes a bfloat16 input the same way, so plain transformers and
    load_compressed reproduce the in-memory logits exactly (they were 0.012-0.035 apart when layerwise
    computed in float32)."""
    from transformers import AutoModelForCausalLM

    model = bfloat16_llama()
    out = tmp_path / "out"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layerwise.compress(model, preset, dataset=BATCHES, output_dir=out, show_progress=False)
        reloads = {"transformers": AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16),
                   "load_compressed": layerwise.load_compressed(out, dtype=torch.bfloat16)}
    expected = logits(model)
    assert expected.dtype == torch.bfloat16
    for how, reloaded in reloads.items():
        got = logits(reloaded.eval())
        assert torch.equal(got, expected), f"{how}: max abs diff {(got - expected).abs().max().item()}"
        for name, module in quantized_modules(model).items():
            assert torch.equal(reloaded.get_submodule(name).weight, module.weight), f"{how}: {name}"
