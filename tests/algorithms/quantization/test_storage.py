import torch

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import fake_quantize_weight, weight_qparams
from layerwise.algorithms.quantization.storage import (
    linear_weight,
    quantized_modules,
    set_quantized_weight,
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
