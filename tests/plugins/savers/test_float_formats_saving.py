"""NVFP4, MXFP4 and MXFP8 checkpoints: the bytes compressed-tensors' own compressors write for the same
quantized values, decompression by compressed-tensors to the in-memory weights, and a plain reload.

bfloat16 models: compressed-tensors decompresses FP4 in bfloat16 (its unpacking dtype), the dtype these
formats are served from; the in-memory weights are bfloat16 too, so every weight comparison is exact.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import layerwise
from layerwise.algorithms.quantization.storage import quantized_modules
from layerwise.errors import RecipeError
from layerwise.testing import token_batches
from tests.conftest import build_tiny_llama

BATCHES = token_batches(2, 16, vocab=128)
FORMATS = {"NVFP4A16": "nvfp4-pack-quantized", "MXFP4A16": "mxfp4-pack-quantized", "MXFP8A16": "mxfp8-quantized"}
#: round-to-nearest, GPTQ solved in groups of the format's block, AWQ smoothing then round-to-nearest, and
#: round-to-nearest with the MSE observer's clipped block scales (NVFP4's relative to its global scale)
RECIPES = [*FORMATS, *(f"GPTQ_{preset}" for preset in FORMATS), "AWQ_NVFP4A16", "AWQ_MXFP4A16",
           *(f"MSE_{preset}" for preset in FORMATS)]
CALIBRATED = ("GPTQ_", "AWQ_")


def compressed(preset, out):
    model = build_tiny_llama(hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    data = {"dataset": token_batches(16, 16, vocab=128)} if preset.startswith(CALIBRATED) else {}
    if preset.startswith("MSE_"):
        preset = [{"QuantizationModifier": {"scheme": preset.removeprefix("MSE_"), "observer": "mse"}}]
    layerwise.compress(model, preset, output_dir=out, show_progress=False, **data)
    return model


def ct_scheme(folder, name):
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    (group,) = config.config_groups.values()
    return group


@pytest.fixture(scope="module", params=RECIPES)
def saved(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param) / "out"
    preset = request.param.split("_", 1)[1] if request.param.startswith((*CALIBRATED, "MSE_")) else request.param
    return preset, compressed(request.param, out), out


def test_config_names_the_format_and_compressed_tensors_reads_it(saved):
    preset, _, out = saved
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["format"] == FORMATS[preset]
    weights = quant["config_groups"]["group_0"]["weights"]
    expected = {"NVFP4A16": ("tensor_group", 16, "torch.float8_e4m3fn", 4), "MXFP4A16": ("group", 32, "torch.uint8", 4),
                "MXFP8A16": ("group", 32, "torch.uint8", 8)}[preset]
    assert (weights["strategy"], weights["group_size"], weights["scale_dtype"], weights["num_bits"]) == expected
    from compressed_tensors.compressors.format import infer_module_format

    assert infer_module_format(torch.nn.Linear, ct_scheme(out, preset)).value == FORMATS[preset]


def test_bytes_equal_compressed_tensors_own_compressor(saved):
    """compressed-tensors compresses the in-memory (fake-quantized) weights with their scales: every stored
    tensor is the same, byte for byte."""
    from compressed_tensors.compressors.base import BaseCompressor

    preset, model, out = saved
    stored = load_file(out / "model.safetensors")
    scheme = ct_scheme(out, preset)
    compressor = BaseCompressor.get_value_from_registry(FORMATS[preset])
    for name, module in quantized_modules(model).items():
        state = {"weight": module.weight.detach(), "weight_scale": module.weight_scale}
        if preset == "NVFP4A16":  # compressed-tensors holds the fp8 block scale and divides by the global scale
            state["weight_scale"] = module.weight_scale * module.weight_global_scale
            state["weight_global_scale"] = module.weight_global_scale
        theirs = compressor.compress(state, scheme)
        ours = {k.removeprefix(f"{name}."): v for k, v in stored.items() if k.startswith(f"{name}.")}
        assert sorted(ours) == sorted(theirs), name
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, f"{name}.{key}"
            assert torch.equal(ours[key].view(torch.uint8), value.contiguous().view(torch.uint8)), f"{name}.{key}"


def test_compressed_tensors_decompresses_to_the_in_memory_weights(saved):
    from compressed_tensors.compressors.base import BaseCompressor

    preset, model, out = saved
    stored = load_file(out / "model.safetensors")
    scheme = ct_scheme(out, preset)
    compressor = BaseCompressor.get_value_from_registry(FORMATS[preset])
    for name, module in quantized_modules(model).items():
        state = {k.removeprefix(f"{name}."): v for k, v in stored.items() if k.startswith(f"{name}.")}
        weight = compressor.decompress(state, scheme)["weight"]
        assert torch.equal(weight.to(torch.bfloat16), module.weight.detach()), name


def test_plain_reload_gives_the_in_memory_weights_and_outputs(saved):
    _preset, model, out = saved
    reloaded = layerwise.load_compressed(out, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # a bfloat16 model cast with .to() keeps bfloat16 rotary frequencies, a loaded one
        expected = model(**BATCHES[0]).logits  # float32 ones: the logits differ by bfloat16 rounding only
        torch.testing.assert_close(reloaded(**BATCHES[0]).logits, expected, rtol=0, atol=2 ** -6 * expected.abs().max().item())
    for name, module in quantized_modules(model).items():  # after a forward every layer is decompressed
        assert torch.equal(reloaded.get_submodule(name).weight.detach(), module.weight.detach()), name


def test_saved_size_is_the_format_bit_count(saved):
    preset, model, out = saved
    stored = load_file(out / "model.safetensors")
    for name, module in quantized_modules(model).items():
        rows, cols = module.weight.shape
        nbytes = sum(v.numel() * v.element_size() for k, v in stored.items() if k.startswith(f"{name}."))
        bits = {"NVFP4A16": 4 + 8 / 16, "MXFP4A16": 4 + 8 / 32, "MXFP8A16": 8 + 8 / 32}[preset]
        assert nbytes == rows * cols * bits / 8 + (4 if preset == "NVFP4A16" else 0), name


def test_nvfp4_fused_projections_share_their_global_scale(tmp_path):
    model = compressed("NVFP4A16", tmp_path / "out")
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert torch.equal(attn.q_proj.weight_global_scale, attn.k_proj.weight_global_scale)
    assert torch.equal(attn.q_proj.weight_global_scale, attn.v_proj.weight_global_scale)
    assert torch.equal(mlp.gate_proj.weight_global_scale, mlp.up_proj.weight_global_scale)
    assert not torch.equal(attn.o_proj.weight_global_scale, attn.q_proj.weight_global_scale)


@pytest.mark.parametrize("preset", list(FORMATS))
def test_a_width_the_block_does_not_divide_is_an_error_naming_the_layer(preset, tmp_path):
    model = build_tiny_llama(hidden_size=64, intermediate_size=136)  # down_proj has 136 inputs
    with pytest.raises(RecipeError, match=r"down_proj.*136.*ignore"):
        layerwise.compress(model, preset, output_dir=tmp_path / "out", show_progress=False)


def test_block_formats_refuse_conv1d(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=128, n_positions=32))
    with pytest.raises(RecipeError, match="Conv1D"):
        layerwise.compress(model, "NVFP4A16", output_dir=tmp_path / "out", show_progress=False)


def test_a_float32_reload_runs(saved):
    """compressed-tensors unpacks FP4 in bfloat16, which its compressed forward cannot mix with a float32
    model: load_compressed dequantizes those folders on load and decodes them again in float32 (the
    bfloat16 model held those values rounded to bfloat16)."""
    _, model, out = saved
    reloaded = layerwise.load_compressed(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.isfinite(reloaded(**BATCHES[0]).logits).all()
    for name, module in quantized_modules(model).items():
        weight = reloaded.get_submodule(name).weight.detach()
        assert weight.dtype == torch.float32 and torch.equal(weight.to(torch.bfloat16), module.weight.detach()), name


def test_nvfp4_mlp_and_fp8_attention_save_as_mixed_precision(tmp_path):
    model = build_tiny_llama(hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    recipe = [{"QuantizationModifier": {"scheme": "NVFP4A16", "targets": [r"re:.*mlp\..*_proj$"]}},
              {"QuantizationModifier": {"scheme": "FP8_DYNAMIC", "targets": [r"re:.*self_attn\..*_proj$"]}}]
    layerwise.compress(model, recipe, output_dir=tmp_path / "out", show_progress=False)
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "mixed-precision"
    assert sorted(group["format"] for group in quant["config_groups"].values()) == [
        "float-quantized", "nvfp4-pack-quantized"]
    reloaded = layerwise.load_compressed(tmp_path / "out", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        reloaded(**BATCHES[0])
    modules = quantized_modules(model)
    assert len(modules) == 14
    for name, module in modules.items():
        assert torch.equal(reloaded.get_submodule(name).weight, module.weight), name


@pytest.mark.parametrize("fp8", ["FP8_DYNAMIC", "FP8"])
def test_a_float32_mixed_precision_folder_with_nvfp4_reloads_to_the_in_memory_model(fp8, tmp_path):
    """transformers' dequantize-on-load fails on NVFP4 tensors beside an FP8 group; load_compressed loads the FP8
    group through it alone and decodes the NVFP4 layers itself: the in-memory weights and outputs exactly (the
    FP8 layers' input quantization put back: dequantized, they lose it; static scales read from the folder)."""
    import warnings

    model = build_tiny_llama(hidden_size=64, intermediate_size=128)
    recipe = [{"QuantizationModifier": {"scheme": "NVFP4A16", "targets": [r"re:.*mlp\..*_proj$"]}},
              {"QuantizationModifier": {"scheme": fp8, "targets": [r"re:.*self_attn\..*_proj$"]}}]
    layerwise.compress(model, recipe, dataset=BATCHES if fp8 == "FP8" else None, output_dir=tmp_path / "out",
                       show_progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the static scales transformers drops are read back
        reloaded = layerwise.load_compressed(tmp_path / "out").eval()
    for name, module in quantized_modules(model).items():
        weight = reloaded.get_submodule(name).weight
        assert weight.dtype == torch.float32 and torch.equal(weight, module.weight), name
    with torch.no_grad():
        assert torch.equal(reloaded(**BATCHES[0]).logits, model(**BATCHES[0]).logits)


def test_a_quiet_float32_reload_still_says_what_the_checkpoint_lacks(tmp_path):
    from safetensors.torch import load_file, save_file

    model = build_tiny_llama(hidden_size=64, intermediate_size=128)
    layerwise.compress(model, "NVFP4A16", output_dir=tmp_path / "out", show_progress=False)
    weights = tmp_path / "out" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.norm.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.warns(UserWarning, match="the checkpoint and the model disagree: missing model.norm.weight"):
        layerwise.load_compressed(tmp_path / "out")


def test_awq_refuses_nvfp4_inputs_whose_global_scale_smoothing_would_change():
    with pytest.raises(RecipeError, match="calibrated input scales"):
        layerwise.compress(build_tiny_llama(hidden_size=64, intermediate_size=128), "AWQ_NVFP4",
                           dataset=BATCHES, show_progress=False)


@pytest.mark.parametrize("preset", list(FORMATS))
def test_a_float32_model_reloads_to_its_own_weights_and_outputs(preset, tmp_path):
    """compressed-tensors decodes in bfloat16; load_compressed decodes a float32 model's layers again in
    float32, so the reload is the in-memory model exactly (its inputs are not quantized: weight-only here)."""
    model = build_tiny_llama(hidden_size=64, intermediate_size=128)
    layerwise.compress(model, preset, output_dir=tmp_path / "out", show_progress=False)
    reloaded = layerwise.load_compressed(tmp_path / "out").eval()
    for name, module in quantized_modules(model).items():
        assert torch.equal(reloaded.get_submodule(name).weight, module.weight), name
    with torch.no_grad():
        assert torch.equal(reloaded(**BATCHES[0]).logits, model(**BATCHES[0]).logits)


@pytest.mark.parametrize("preset", ["NVFP4", "MXFP4", "MXFP8"])
def test_a_float32_reload_quantizes_the_inputs_again(preset, tmp_path, capfd):
    """With quantized inputs too: the float32 reload puts each layer's input quantization back (NVFP4's
    calibrated global input scale read from the checkpoint), so its outputs are the in-memory model's; and
    quietly: transformers' notices about the path it takes (the scales 'unexpected') are answered, not shown."""
    import warnings

    model = build_tiny_llama(hidden_size=64, intermediate_size=128)
    data = [batch["input_ids"] for batch in BATCHES]
    layerwise.compress(model, preset, dataset=[{"input_ids": ids} for ids in data], output_dir=tmp_path / "out",
                       show_progress=False)
    capfd.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        reloaded = layerwise.load_compressed(tmp_path / "out").eval()
    assert "UNEXPECTED" not in capfd.readouterr().err
    quantized = quantized_modules(model)
    assert all(getattr(reloaded.get_submodule(n), "input_quantization_args", None) == m.input_quantization_args
               for n, m in quantized.items())
    if preset == "NVFP4":
        name, module = next(iter(quantized.items()))
        assert torch.equal(reloaded.get_submodule(name).input_global_scale, module.input_global_scale)
    with torch.no_grad():
        assert torch.equal(reloaded(**BATCHES[0]).logits, model(**BATCHES[0]).logits)
