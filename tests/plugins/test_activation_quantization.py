"""Input-activation quantization (W8A8, W8A8_STATIC, FP8_DYNAMIC, FP8, FP8_BLOCK): numerics, calibration
on the quantized model's own activations, saving in the formats vLLM reads, reloading exactly."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import FP8_MAX, fake_quantize, fake_quantize_activation
from layerwise.errors import RecipeError
from layerwise.plugins.modifiers.gptq import GPTQModifier
from layerwise.plugins.modifiers.quantization import QuantizationModifier
from layerwise.plugins.savers.compressed_tensors import save_compressed
from layerwise.testing import token_batches
from tests.conftest import build_tiny_llama

BATCHES = token_batches(4, 16, vocab=128)
#: scheme -> (stored weight dtype, format)
FORMATS = {"W8A8": (torch.int8, "int-quantized"), "W8A8_STATIC": (torch.int8, "int-quantized"),
           "FP8_DYNAMIC": (torch.float8_e4m3fn, "float-quantized"), "FP8": (torch.float8_e4m3fn, "float-quantized"),
           "FP8_BLOCK": (torch.float8_e4m3fn, "float-quantized")}


def wide_llama():
    """Widths that are multiples of 128, for FP8_BLOCK's 128 x 128 tiles and groups of 128 inputs."""
    return build_tiny_llama(hidden_size=128, intermediate_size=256)


def compressed(scheme, model=None, modifier_cls=QuantizationModifier, **fields):
    model = model or (wide_llama() if scheme == "FP8_BLOCK" else build_tiny_llama())
    modifier = modifier_cls(scheme=scheme, **fields)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layerwise.compress(model, [modifier], dataset=BATCHES if modifier.requires_data else None,
                           show_progress=False, device="cpu")
    return model


def logits(model, batch=BATCHES[0]):
    with torch.no_grad():
        return model(**batch).logits


@pytest.mark.parametrize("scheme", list(FORMATS))
def test_the_saved_checkpoint_reloads_to_layerwise_s_outputs(scheme, tmp_path):
    model = compressed(scheme)
    save_compressed(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    dtype, fmt = FORMATS[scheme]
    assert config["format"] == fmt
    (group,) = config["config_groups"].values()
    assert group["input_activations"]["type"] == ("float" if "FP8" in scheme else "int")
    assert group["input_activations"]["dynamic"] is (scheme in ("W8A8", "FP8_DYNAMIC", "FP8_BLOCK"))
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "out" / "model.safetensors")
    assert tensors["model.layers.0.mlp.down_proj.weight"].dtype == dtype
    assert ("model.layers.0.mlp.down_proj.input_scale" in tensors) is (scheme in ("W8A8_STATIC", "FP8"))
    reloaded = layerwise.load_compressed(tmp_path / "out", model_class=type(model)).eval()
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=1e-5, atol=1e-6)


def test_activations_change_the_output_beyond_the_weights():
    # the same weights with and without the input quantization: W8A8 really quantizes inputs
    model = compressed("W8A8")
    plain = compressed("W8A16")
    assert not torch.allclose(logits(model), logits(plain), atol=1e-6)
    layer = model.model.layers[0].mlp.down_proj
    assert torch.equal(layer.weight, plain.model.layers[0].mlp.down_proj.weight)


def test_static_scales_are_calibrated_on_the_quantized_model_s_own_activations():
    model = compressed("W8A8_STATIC")
    seen: dict[str, float] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, n=n: seen.__setitem__(
        n, max(seen.get(n, 0.0), float(args[0].abs().max())))) for n, m in model.named_modules()
        if hasattr(m, "input_quantization_args")]
    for batch in BATCHES:
        logits(model, batch)
    for hook in hooks:
        hook.remove()
    assert len(seen) == 14
    for name, peak in seen.items():
        # symmetric int8: scale = max|x| / 127.5 over the inputs the quantized model itself produces
        stored = float(model.get_submodule(name).input_scale)
        assert stored == pytest.approx(peak / 127.5, rel=1e-5), name


def test_float8_keeps_representable_values_and_rounds_the_rest_to_e4m3():
    args = QuantizationArgs(type="float", num_bits=8, strategy="tensor", group_size=None)
    scale = torch.tensor([0.5])
    grid = torch.tensor([0.0, 0.015625, 1.0, 1.125, 3.5, -240.0, 448.0]) * 0.5  # e4m3 values times the scale
    assert torch.equal(fake_quantize(grid, scale, None, args), grid)
    assert torch.equal(fake_quantize(torch.tensor([1.06 * 0.5, 1000.0]), scale, None, args),
                       torch.tensor([1.0 * 0.5, FP8_MAX * 0.5]))


@pytest.mark.parametrize("kind", ["int", "float"])
def test_static_and_dynamic_scales_agree_on_a_constant_input(kind):
    dynamic = QuantizationArgs(type=kind, num_bits=8, strategy="token", group_size=None, dynamic=True)
    static = QuantizationArgs(type=kind, num_bits=8, strategy="tensor", group_size=None)
    row = torch.randn(64, generator=torch.Generator().manual_seed(0))
    x = row.expand(5, 64).clone()
    scale = row.abs().max() / (FP8_MAX if kind == "float" else 127.5)
    torch.testing.assert_close(fake_quantize_activation(x, dynamic), fake_quantize_activation(x, static, scale),
                               rtol=0, atol=0)


def test_gptq_w8a8_quantizes_inputs_too_and_reloads(tmp_path):
    model = compressed("W8A8", modifier_cls=GPTQModifier, block_size=32)
    assert all(hasattr(m, "input_quantization_args") for m in model.model.layers[1].modules()
               if isinstance(m, torch.nn.Linear))
    save_compressed(model, tmp_path / "out")
    reloaded = layerwise.load_compressed(tmp_path / "out", model_class=type(model)).eval()
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=1e-5, atol=1e-6)


def test_only_static_input_scales_need_data():
    assert not QuantizationModifier(scheme="W8A8").requires_data
    assert not QuantizationModifier(scheme="FP8_DYNAMIC").requires_data
    assert QuantizationModifier(scheme="W8A8_STATIC").requires_data
    with pytest.raises(Exception, match="QuantizationModifier"):
        layerwise.compress(build_tiny_llama(), "W8A8_STATIC", show_progress=False, device="cpu")


def test_activation_schemes_are_refused_on_conv1d_before_calibrating():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32)).eval()
    with pytest.raises(RecipeError, match=r"layer 'transformer.h.0.attn.c_attn' is a transformers Conv1D .*"
                                          r"input-activation quantization is for nn.Linear layers only"):
        layerwise.compress(model, [QuantizationModifier(scheme="W8A8", ignore=["lm_head"])], show_progress=False, device="cpu")
    assert model.transformer.h[0].attn.c_attn.weight.dtype == torch.float32  # nothing was touched


@pytest.mark.parametrize("fields,message", [
    ({"scheme": {"weights": {"num_bits": 8, "strategy": "token"}}}, r"weights: strategy 'token' is not for weights"),
    ({"scheme": {"preset": "W8A8", "input_activations": {"strategy": "token"}}},
     r"static \(calibrated\) scales are one per tensor; strategy 'token' needs dynamic: true"),
    ({"scheme": {"weights": {"type": "float", "num_bits": 3}}}, r"type .float. is float8 e4m3 \(num_bits 8\) or fp4"),
])
def test_bad_activation_schemes_are_recipe_errors(fields, message):
    with pytest.raises(RecipeError, match=message):
        QuantizationModifier(**fields)


def test_an_input_group_that_does_not_divide_a_layer_is_named_before_calibrating():
    with pytest.raises(RecipeError, match=r"input_activations group_size 128 does not divide the 64 inputs of layer"):
        compressed("FP8_BLOCK", model=build_tiny_llama())


def test_gptq_refuses_block_weights():
    with pytest.raises(RecipeError, match="strategy 'block' .* is round-to-nearest only"):
        GPTQModifier(scheme="FP8_BLOCK")


def test_smoothquant_then_gptq_w8a8_is_one_preset_one_run_and_reloads(tmp_path):
    def run(recipe, **options):
        model, forwards = build_tiny_llama(), []
        for layer in model.model.layers:
            layer.register_forward_pre_hook(lambda m, a: forwards.append(1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layerwise.compress(model, recipe, dataset=BATCHES, show_progress=False,
                               options=layerwise.CompressOptions.of(**options))
        return model, len(forwards)

    model, forwards = run("SQ_GPTQ_W8A8")
    assert model.layerwise_report.modifiers == ["SmoothQuantModifier", "GPTQModifier"]
    # SmoothQuant adds no forward to GPTQ's own run at blocks: the two share one calibration run
    assert forwards == run("GPTQ_W8A8", pieces="blocks")[1]
    save_compressed(model, tmp_path / "out")
    reloaded = layerwise.load_compressed(tmp_path / "out", model_class=type(model)).eval()
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=1e-5, atol=1e-6)


def test_two_schemes_of_two_formats_save_as_mixed_precision_and_reload(tmp_path):
    model = build_tiny_llama()
    layerwise.compress(model, [QuantizationModifier(scheme="W8A8", targets=["re:.*mlp.*"]),
                               QuantizationModifier(scheme="W4A16", group_size=32, targets=["re:.*self_attn.*"])],
                       show_progress=False, device="cpu")
    save_compressed(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision"
    assert sorted(group["format"] for group in config["config_groups"].values()) == ["int-quantized",
                                                                                      "pack-quantized"]
    reloaded = layerwise.load_compressed(tmp_path / "out", model_class=type(model)).eval()
    torch.testing.assert_close(logits(reloaded), logits(model), rtol=1e-5, atol=1e-6)
