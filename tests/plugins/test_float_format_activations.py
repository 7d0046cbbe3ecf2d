"""NVFP4, MXFP4 and MXFP8 inputs: fake quantization against references from the definitions, NVFP4's
calibrated global input scale, and the quantized layers computing exactly what compressed-tensors' own
forward computes on the reloaded checkpoint (bfloat16, the dtype it runs these formats in)."""

from __future__ import annotations

import json

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization.presets import PRESETS
from layerwise.algorithms.quantization.qmath import fake_quantize_activation
from layerwise.algorithms.quantization.storage import quantized_modules
from layerwise.errors import DatasetError
from layerwise.testing import token_batches
from tests.algorithms.quantization.test_float_formats import reference_fp4, reference_mx_scale
from tests.conftest import build_tiny_llama

BATCHES = token_batches(4, 16, vocab=128)


def test_nvfp4_inputs_follow_the_definition():
    args = PRESETS["NVFP4"].input_activations
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * 4
    g = torch.tensor([448 * 6 / 20.0])  # a calibrated global scale: the range seen was 20
    got = fake_quantize_activation(x, args, global_scale=g)
    blocks = x.reshape(3, 5, 4, 16)
    s8 = (g * blocks.abs().amax(dim=-1, keepdim=True) / 6).clamp(max=448).to(torch.float8_e4m3fn).to(torch.float32)
    scale = s8 / g
    expected = torch.tensor([reference_fp4(v) for v in (blocks / scale).reshape(-1).tolist()]).reshape(blocks.shape)
    assert torch.equal(got, (expected * scale).reshape(x.shape))
    with pytest.raises(ValueError, match="global input scale"):
        fake_quantize_activation(x, args)


@pytest.mark.parametrize("preset, emax", [("MXFP4", 2), ("MXFP8", 8)])
def test_mx_inputs_follow_the_definition(preset, emax):
    args = PRESETS[preset].input_activations
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1)) * 3
    got = fake_quantize_activation(x, args)
    blocks = x.reshape(2, 7, 2, 32)
    scale = torch.tensor([reference_mx_scale(a, emax) for a in blocks.abs().amax(dim=-1).reshape(-1).tolist()])
    scale = scale.reshape(2, 7, 2, 1)
    if preset == "MXFP4":
        grid = torch.tensor([reference_fp4(v) for v in (blocks / scale).reshape(-1).tolist()]).reshape(blocks.shape)
    else:
        grid = (blocks / scale).to(torch.float8_e4m3fn).to(torch.float32)
    assert torch.equal(got, (grid * scale).reshape(x.shape))


def test_nvfp4_global_input_scale_is_calibrated_on_the_inputs_the_model_produces():
    batches = [*BATCHES, *token_batches(2, 9, vocab=128)]  # batches of different lengths
    model = build_tiny_llama(hidden_size=64, intermediate_size=128)
    layerwise.compress(model, "NVFP4", dataset=batches, show_progress=False)
    seen: dict[str, float] = {}
    hooks = [module.register_forward_pre_hook(
        lambda m, args, n=name: seen.__setitem__(n, max(seen.get(n, 0.0), args[0].abs().max().item())))
        for name, module in quantized_modules(model).items()]
    with torch.no_grad():
        for batch in batches:
            model(**batch)
    for hook in hooks:
        hook.remove()
    for name, module in quantized_modules(model).items():
        assert module.input_global_scale.dtype == torch.float32
        assert module.input_global_scale.item() == pytest.approx(448 * 6 / seen[name], rel=1e-6), name


def test_nvfp4_inputs_need_data_and_mx_inputs_do_not(tmp_path):
    with pytest.raises(DatasetError, match="needs calibration data"):
        layerwise.compress(build_tiny_llama(hidden_size=64, intermediate_size=128), "NVFP4", show_progress=False)
    layerwise.compress(build_tiny_llama(hidden_size=64, intermediate_size=128), "MXFP8", show_progress=False)


@pytest.mark.parametrize("preset", ["NVFP4", "MXFP4", "MXFP8"])
def test_layers_compute_what_compressed_tensors_computes_on_the_reloaded_checkpoint(preset, tmp_path):
    model = build_tiny_llama(hidden_size=64, intermediate_size=128).to(torch.bfloat16)
    data = {"dataset": BATCHES} if preset == "NVFP4" else {}
    layerwise.compress(model, preset, output_dir=tmp_path / "out", show_progress=False, **data)
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    inputs = quant["config_groups"]["group_0"]["input_activations"]
    assert inputs["dynamic"] == ("local" if preset == "NVFP4" else True)
    reloaded = layerwise.load_compressed(tmp_path / "out", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        reloaded(**BATCHES[0])  # compressed-tensors decompresses on the first forward
        x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(2)) * 2).to(torch.bfloat16)
        for name, module in quantized_modules(model).items():
            if module.weight.shape[1] != 64:
                continue
            theirs = reloaded.get_submodule(name)
            assert theirs.quantization_scheme.input_activations is not None
            ours, expected = module(x), theirs(x)
            if preset != "NVFP4":
                assert torch.equal(ours, expected), name
                continue
            # compressed-tensors' reference forward rounds amax / 6 to bfloat16 before multiplying by the
            # global scale (vLLM's kernel, like layerwise, computes the block scale in float32): with that
            # one rounding added, layerwise's arithmetic gives compressed-tensors' outputs exactly
            assert torch.equal(torch.nn.functional.linear(_ct_rounded_nvfp4(x, module.input_global_scale),
                                                          module.weight), expected), name
            assert ((ours - expected).norm() / expected.norm()).item() < 0.05, name


def _ct_rounded_nvfp4(x, global_scale):
    """NVFP4 input fake quantization with compressed-tensors' reference rounding of ``amax / 6`` to x's dtype."""
    from layerwise.algorithms.quantization.float_formats import fp4_grid

    blocks = x.reshape(*x.shape[:-1], -1, 16)
    s8 = (global_scale * (blocks.abs().amax(dim=-1, keepdim=True) / 6)).clamp(max=448)
    scale = s8.to(torch.float8_e4m3fn).to(torch.float32) / global_scale
    return (fp4_grid(blocks.to(torch.float32) / scale) * scale).reshape(x.shape).to(x.dtype)
