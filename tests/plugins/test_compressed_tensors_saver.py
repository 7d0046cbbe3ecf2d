"""Quantize, save in compressed-tensors, reload with transformers: same outputs, really packed weights."""

import json

import pytest
import torch
from safetensors import safe_open

from layerwise.algorithms.quantization.storage import quantized_modules
from layerwise.host.lifecycle import Lifecycle
from layerwise.host.plugin_manager import registry
from layerwise.host.state import CompressionState
from tests.conftest import build_tiny_llama, make_word_tokenizer

# W4A16's group of 128 needs in_features divisible by 128: a tiny Llama with hidden 128
LLAMA = dict(hidden_size=128, intermediate_size=256)


def quantize(model, scheme, **fields):
    modifier = registry("modifiers").get("QuantizationModifier")(scheme=scheme, **fields)
    lifecycle = Lifecycle(CompressionState(model, [modifier]))
    lifecycle.initialize()
    lifecycle.calibration_start()
    lifecycle.calibration_end()
    lifecycle.finalize()
    return model


def save(model, out, **kwargs):
    return registry("savers").get("compressed-tensors")(model, out, **kwargs)


def check_packed(out, model, bits, symmetric):
    modules = quantized_modules(model)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for name, module in modules.items():
            out_f, in_f = module.weight.shape
            assert f"{name}.weight" not in keys
            packed = f.get_tensor(f"{name}.weight_packed")
            assert packed.dtype == torch.int32 and tuple(packed.shape) == (out_f, in_f * bits // 32)
            assert f.get_tensor(f"{name}.weight_shape").tolist() == [out_f, in_f]
            assert f.get_tensor(f"{name}.weight_scale").dtype == module.weight.dtype
            assert (f"{name}.weight_zero_point" in keys) == (not symmetric)
    return keys


@pytest.mark.parametrize("scheme, bits, symmetric", [("W4A16", 4, True), ("W8A16", 8, True),
                                                     ("W4A16_ASYM", 4, False)])
def test_tiny_llama_reloads_with_the_same_outputs(tmp_path, scheme, bits, symmetric):
    from transformers import AutoModelForCausalLM

    model = quantize(build_tiny_llama(**LLAMA), scheme)
    out = tmp_path / "out"
    assert save(model, out, tokenizer=make_word_tokenizer(128), recipe={"QuantizationModifier": {"scheme": scheme}},
                extra_files={"gptq_log.json": "[]", "sub/blob.bin": b"\x00\x01"}) == out
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert config["ignore"] == ["lm_head"]
    (group,) = config["config_groups"].values()
    assert group["targets"] == ["Linear"]
    assert group["weights"]["num_bits"] == bits and group["weights"]["symmetric"] is symmetric
    assert (out / "tokenizer.json").is_file() and (out / "gptq_log.json").read_text() == "[]"
    assert (out / "sub" / "blob.bin").read_bytes() == b"\x00\x01"
    assert scheme in (out / "recipe.yaml").read_text()
    check_packed(out, model, bits, symmetric)

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = model(ids).logits, reloaded(ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    for name, module in quantized_modules(model).items():
        torch.testing.assert_close(reloaded.get_submodule(name).weight, module.weight, rtol=0, atol=1e-7)


@pytest.mark.parametrize("scheme, bits, symmetric", [("W4A16", 4, True), ("W8A16", 8, True),
                                                     ("W4A16_ASYM", 4, False)])
def test_minilm_reloads_with_the_same_outputs(tmp_path, minilm_path, scheme, bits, symmetric):
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(minilm_path).eval()
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    quantize(model, scheme)
    assert len(quantized_modules(model)) == 6 * 6 + 1  # q, k, v, attn out, intermediate, output; pooler
    out = tmp_path / "minilm"
    save(model, out, tokenizer=tokenizer)
    check_packed(out, model, bits, symmetric)
    reloaded = AutoModel.from_pretrained(out).eval()
    batch = tokenizer(["a quantized sentence encoder", "saved and loaded back"], padding=True,
                      return_tensors="pt")
    with torch.no_grad():
        expected, got = model(**batch).last_hidden_state, reloaded(**batch).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * expected.abs().max().item())


def test_unquantized_model_is_refused(tmp_path):
    with pytest.raises(Exception, match="no quantized module"):
        save(build_tiny_llama(), tmp_path / "out")
    assert not (tmp_path / "out").exists()


class Boom(Exception):
    pass


@pytest.mark.parametrize("error", [Boom, KeyboardInterrupt])
def test_failure_while_writing_leaves_nothing(tmp_path, error):
    model = quantize(build_tiny_llama(), "W8A16")

    class BrokenTokenizer:
        def save_pretrained(self, folder):
            (folder / "tokenizer.json").write_text("{}")  # half written ...
            raise error("disk full")

    with pytest.raises(error):
        save(model, tmp_path / "out", tokenizer=BrokenTokenizer())
    assert list(tmp_path.iterdir()) == []


def test_existing_folder_needs_overwrite(tmp_path):
    model = quantize(build_tiny_llama(), "W8A16")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"'.*out'.*overwrite=True"):
        save(model, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    with pytest.raises(FileExistsError, match=r"not written by layerwise.*'keep.txt'.*overwrite='any'"):
        save(model, out, overwrite=True)  # a folder layerwise did not write needs the explicit "any"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    save(model, out, overwrite="any")
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_empty_existing_folder_is_fine(tmp_path):
    (tmp_path / "out").mkdir()
    save(quantize(build_tiny_llama(), "W8A16"), tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()


def test_two_schemes_become_two_config_groups_and_reload(tmp_path):
    from transformers import AutoModelForCausalLM

    qm = registry("modifiers").get("QuantizationModifier")
    model = build_tiny_llama()
    modifiers = [qm(scheme="W8A16", targets=["re:.*mlp.*"]),
                 qm(scheme={"num_bits": 4, "group_size": 32, "actorder": "static"}, targets=["re:.*self_attn.*"],
                    ignore=["lm_head", "re:.*o_proj"])]
    lifecycle = Lifecycle(CompressionState(model, modifiers))
    lifecycle.initialize()
    lifecycle.calibration_end()
    save(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert sorted(config["ignore"]) == ["lm_head", "model.layers.0.self_attn.o_proj",
                                        "model.layers.1.self_attn.o_proj"]
    bits = sorted(group["weights"]["num_bits"] for group in config["config_groups"].values())
    assert bits == [4, 8]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0,
                                   atol=1e-5 * expected.abs().max().item())


def test_reordered_group_index_is_refused_with_the_fix(tmp_path):
    model = quantize(build_tiny_llama(), "W4A16", group_size=32)
    module = model.model.layers[0].mlp.up_proj
    module.register_buffer("weight_g_idx", torch.arange(64, dtype=torch.int32).flip(0) // 32, persistent=False)
    with pytest.raises(Exception, match="actorder='static'"):
        save(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4afp8_bytes_equal_compressed_tensors_own_compressor(tmp_path, dtype):
    """W4AFP8 (int4 weights in groups of 128, FP8 inputs per token) packs its weights although
    compressed-tensors would infer ``int-quantized`` for quantized inputs: its own ``pack-quantized``
    compressor, given the in-memory (fake-quantized) weights and scales, writes every stored tensor byte for byte."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    import layerwise

    model = build_tiny_llama(**LLAMA).to(dtype)
    layerwise.compress(model, "W4AFP8", output_dir=tmp_path / "out", show_progress=False)
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    (scheme,) = QuantizationConfig.model_validate(config).config_groups.values()
    assert scheme.format == "pack-quantized" and scheme.input_activations.type == "float"
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    stored = load_file(tmp_path / "out" / "model.safetensors")
    modules = quantized_modules(model)
    assert len(modules) == 14
    for name, module in modules.items():
        state = {"weight": module.weight.detach(), "weight_scale": module.weight_scale}
        theirs = compressor.compress(state, scheme)
        ours = {k.removeprefix(f"{name}."): v for k, v in stored.items() if k.startswith(f"{name}.")}
        assert sorted(ours) == sorted(theirs) == ["weight_packed", "weight_scale", "weight_shape"], name
        for key, value in theirs.items():
            assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, f"{name}.{key}"
            assert torch.equal(ours[key].view(torch.uint8), value.contiguous().view(torch.uint8)), f"{name}.{key}"
