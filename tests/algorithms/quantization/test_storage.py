import dataclasses

import pytest
import torch

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import (
    fake_quantize_weight,
    quantize_weight,
    weight_qparams,
)
from layerwise.algorithms.quantization.storage import (
    codes_dtype,
    keeping_codes,
    linear_weight,
    quantized_modules,
    replace_data,
    set_quantized_weight,
    set_weight_qparams,
    take_packed_weight_codes,
    take_weight_codes,
)


def test_linear_stores_fake_quantized_weight_and_qparams():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 8), torch.nn.Linear(8, 4))
    args = QuantizationArgs(4, False, "group", 32)
    w = model[0].weight.detach().clone()
    scale, zp = weight_qparams(w, args)
    set_quantized_weight(model[0], w, scale, zp, args)
    assert torch.equal(model[0].weight, fake_quantize_weight(w, scale, zp, args))
    assert torch.equal(model[0].weight_scale, scale) and torch.equal(model[0].weight_zero_point, zp)
    assert model[0].quantization_args == args
    assert list(quantized_modules(model)) == ["0"]
    assert "0.weight_scale" not in model.state_dict()  # qparams never leak into a plain save


def test_conv1d_is_quantized_in_linear_layout():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(nf=8, nx=64)  # weight is (in=64, out=8)
    torch.nn.init.normal_(conv.weight)
    args = QuantizationArgs(4, True, "group", 32)
    w = linear_weight(conv).detach().clone()
    assert tuple(w.shape) == (8, 64)
    scale, zp = weight_qparams(w, args)
    assert tuple(scale.shape) == (8, 2)
    set_quantized_weight(conv, w, scale, zp, args)
    assert torch.equal(conv.weight, fake_quantize_weight(w, scale, zp, args).t())


def test_quantized_weight_keeps_the_parameter_object_and_ties():
    """The storage is swapped, not written into: holders of the parameter (tied modules, traced
    ``get_attr``) see the quantized values, and a contiguous Conv1D weight stays contiguous."""
    torch.manual_seed(0)
    first, second = torch.nn.Linear(64, 8, bias=False), torch.nn.Linear(64, 8, bias=False)
    second.weight = first.weight  # tied: one parameter object
    param, before = first.weight, first.weight.detach().clone()
    args = QuantizationArgs(4, True, "channel")
    scale, zp = weight_qparams(before, args)
    set_quantized_weight(first, before, scale, zp, args)
    assert first.weight is param and second.weight is param
    assert torch.equal(second.weight, fake_quantize_weight(before, scale, zp, args))
    assert not torch.equal(second.weight, before)


def test_transposed_weight_stays_contiguous():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(nf=8, nx=64)
    torch.nn.init.normal_(conv.weight)
    args = QuantizationArgs(8, True, "channel")
    w = linear_weight(conv).detach().clone()
    scale, zp = weight_qparams(w, args)
    set_quantized_weight(conv, w, scale, zp, args)
    assert conv.weight.is_contiguous() and tuple(conv.weight.shape) == (64, 8)


# -- the codes kept for the saver (compress() with an output folder) --------------------------------------
def _weights_of(preset: str, dtype: torch.dtype):
    from layerwise.algorithms.quantization.presets import PRESETS

    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 200).to(dtype)  # more rows than a slice (slices.SLICE_ELEMENTS)
    with torch.no_grad():
        layer.weight.mul_(torch.randn_like(layer.weight).exp())  # outliers: every code is used
    return layer, PRESETS[preset].weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM", "W8A16", "FP8_DYNAMIC", "FP8_BLOCK", "MXFP8A16"])
def test_kept_codes_are_the_codes_of_the_stored_weight(preset, dtype):
    layer, args = _weights_of(preset, dtype)
    weight = layer.weight.detach().clone()
    scale, zero_point = weight_qparams(weight.float(), args)
    with keeping_codes():
        set_quantized_weight(layer, weight, scale, zero_point, args)
        codes = take_weight_codes(layer)
        assert codes is not None and codes.dtype == codes_dtype(args)
        again = quantize_weight(layer.weight.detach(), layer.weight_scale.float(), layer.weight_zero_point.float(),
                                args)  # what the saver computes without them
        assert torch.equal(codes.to(torch.float32), again)
        assert take_weight_codes(layer) is None  # taken once


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM"])
def test_int4_codes_are_kept_packed_as_the_saver_stores_them(preset):
    from layerwise.algorithms.quantization.int_packing import pack_to_int32

    layer, args = _weights_of(preset, torch.bfloat16)
    weight = layer.weight.detach().clone()
    with keeping_codes():
        set_quantized_weight(layer, weight, *weight_qparams(weight.float(), args), args)
        packed = take_packed_weight_codes(layer)
        again = quantize_weight(layer.weight.detach(), layer.weight_scale.float(), layer.weight_zero_point.float(),
                                args)
        assert torch.equal(packed, pack_to_int32(again.to(torch.int8), 4))
        assert take_packed_weight_codes(layer) is None and take_weight_codes(layer) is None  # taken once
        fp8, fp8_args = _weights_of("FP8_DYNAMIC", torch.bfloat16)
        set_quantized_weight(fp8, fp8.weight.detach(), *weight_qparams(fp8.weight.detach().float(), fp8_args),
                             fp8_args)
        assert take_packed_weight_codes(fp8) is None and take_weight_codes(fp8) is not None  # not packed: kept


def test_codes_not_taken_are_dropped_with_the_context():
    layer, args = _weights_of("W4A16", torch.bfloat16)
    with keeping_codes():
        set_quantized_weight(layer, layer.weight.detach(), *weight_qparams(layer.weight.detach().float(), args), args)
    assert take_weight_codes(layer) is None


def test_no_codes_where_they_would_not_survive_storage_or_outside_the_context():
    layer, args = _weights_of("W8A16", torch.bfloat16)
    asym = dataclasses.replace(args, symmetric=False)  # |q - z| reaches 255: bf16 moves some codes
    scale, zero_point = weight_qparams(layer.weight.detach().float(), asym)
    with keeping_codes():
        set_quantized_weight(layer, layer.weight.detach(), scale, zero_point, asym)
        assert take_weight_codes(layer) is None
    set_quantized_weight(layer, layer.weight.detach(), *weight_qparams(layer.weight.detach().float(), args), args)
    assert take_weight_codes(layer) is None
    with keeping_codes(False):
        set_quantized_weight(layer, layer.weight.detach(), *weight_qparams(layer.weight.detach().float(), args), args)
        assert take_weight_codes(layer) is None


def test_kept_codes_are_forgotten_when_the_weight_or_its_qparams_change():
    layer, args = _weights_of("W4A16", torch.bfloat16)
    with keeping_codes():
        set_quantized_weight(layer, layer.weight.detach(), *weight_qparams(layer.weight.detach().float(), args), args)
        with torch.no_grad():
            layer.weight.mul_(2)  # in place: a new version
        assert take_weight_codes(layer) is None

        set_quantized_weight(layer, layer.weight.detach(), *weight_qparams(layer.weight.detach().float(), args), args)
        replace_data(layer.weight, layer.weight.detach() * 2)  # new storage
        assert take_weight_codes(layer) is None

        set_quantized_weight(layer, layer.weight.detach(), *weight_qparams(layer.weight.detach().float(), args), args)
        set_weight_qparams(layer, layer.weight_scale * 2, layer.weight_zero_point, args)  # new qparams
        assert take_weight_codes(layer) is None
