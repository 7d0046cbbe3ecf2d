"""Where quantization results live on a module, for the forward pass and the saver.

After :func:`set_quantized_weight` a module carries

* ``weight``: the fake-quantized values (so the model computes as it will after reload),
* ``weight_scale`` / ``weight_zero_point`` (buffers, compressed-tensors shapes, Linear layout),
* ``weight_g_idx`` (buffer, int32) when GPTQ reordered columns into groups,
* ``weight_global_scale`` (buffer, float32, ``(1,)``) for NVFP4; the low-bit float formats keep
  ``weight_scale`` as the effective float32 block scale (see :mod:`.float_formats`), whatever the
  weight's dtype, so the saver recovers the stored FP8 / E8M0 scale bytes exactly,
* ``quantization_args``: the :class:`~layerwise.algorithms.quantization.args.QuantizationArgs` used.

After :func:`set_input_quantization` it also carries ``input_quantization_args`` (and, for static
activations, ``input_scale`` / ``input_zero_point`` buffers), and its ``forward`` fake-quantizes its
input first: the model computes as an inference server running the checkpoint will, and the
layers after it are calibrated on those quantized activations. The forward is replaced on the
instance (not a hook): it survives ``copy.deepcopy`` and is no hook for anyone to remove.

transformers' ``Conv1D`` (GPT-2) stores its weight as ``(in, out)``; everything here
takes and returns the ``nn.Linear`` layout ``(out, in)`` and transposes for you.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import fake_quantize_activation, fake_quantize_weight
from layerwise.common.mapped_pages import release_mapped_pages

QPARAM_NAMES = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_global_scale", "input_scale",
               "input_zero_point", "input_global_scale")


def is_transposed(module: nn.Module) -> bool:
    """Does ``module`` store its weight as ``(in, out)`` (transformers' Conv1D)?"""
    return type(module).__name__ == "Conv1D"


def linear_weight(module: nn.Module) -> Tensor:
    """The module's weight in the ``nn.Linear`` layout ``(out, in)`` (a view, not a copy)."""
    weight = module.weight
    return weight.t() if is_transposed(module) else weight


@torch.no_grad()
def set_quantized_weight(module: nn.Module, weight_dequantized: Tensor, scale: Tensor,
                         zero_point: Tensor | None, args: QuantizationArgs, g_idx: Tensor | None = None,
                         on_grid: bool = False, global_scale: Tensor | None = None) -> None:
    """Store the fake-quantized weight and its qparams on ``module`` (what the saver reads).

    ``weight_dequantized`` is in the Linear layout ``(out, in)``; it is fake-quantized
    again with ``scale``/``zero_point`` (a no-op for values already on the grid) so the
    stored weight is exactly what the packed checkpoint decodes to. ``on_grid=True`` says the
    caller computed it as ``(q - zero_point) * scale`` with these very qparams, scale already in
    the weight's dtype (GPTQ and round-to-nearest results): the second pass is skipped. NVFP4 needs the
    ``global_scale`` its block scales were computed with.
    """
    if args.float_format == "nvfp4" and global_scale is None:
        raise ValueError("an NVFP4 weight needs the global_scale its block scales are relative to")
    if zero_point is None:
        zero_point = torch.zeros_like(scale)
    target = module.weight
    # in its own dtype: quantizing divides by the float32 scale a slice at a time, the same values as a float32
    # copy of the whole weight without making one (float64 would divide in float64: it is quantized in float32)
    weight = weight_dequantized.to(device=target.device,
                                   dtype=torch.float32 if weight_dequantized.dtype == torch.float64 else None)
    scale = scale.to(device=target.device)
    zero_point = zero_point.to(device=target.device)
    if g_idx is not None:
        g_idx = g_idx.to(device=target.device, dtype=torch.int32)
    expected = tuple(linear_weight(module).shape)
    if tuple(weight.shape) != expected:
        raise ValueError(f"quantized weight has shape {tuple(weight.shape)}, the module's (out, in) weight "
                         f"is {expected}")
    # the scale is kept in the weight's dtype (compressed-tensors stores it so); quantize with that scale.
    # The low-bit float formats keep float32: their stored FP8 / E8M0 scales are recovered from it exactly
    scale = scale.to(torch.float32 if args.float_format else target.dtype)
    fq = weight if on_grid else fake_quantize_weight(weight, scale.to(torch.float32), zero_point.to(torch.float32),
                                                     args, g_idx)
    replace_data(target, fq.t().contiguous() if is_transposed(module) else fq)
    set_weight_qparams(module, scale, zero_point, args, g_idx, global_scale)


@torch.no_grad()
def set_weight_qparams(module: nn.Module, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs,
                       g_idx: Tensor | None = None, global_scale: Tensor | None = None) -> None:
    """Store the qparams of ``module``'s weight as :func:`set_quantized_weight` does, leaving the weight as it is.

    The saver quantizes the weight again with these qparams, so an unquantized weight encodes to the same
    integers as its fake-quantized values would (they are ``q * scale`` rounded to the weight's dtype, less
    than half a step from ``q * scale`` for every scheme: ``tests/model_io/model_free`` checks the bytes). A
    model-free run uses this to skip the fake quantization it never reads.
    """
    if args.float_format == "nvfp4" and global_scale is None:
        raise ValueError("an NVFP4 weight needs the global_scale its block scales are relative to")
    target = module.weight
    scale = scale.to(device=target.device, dtype=torch.float32 if args.float_format else target.dtype)
    zero_point = torch.zeros_like(scale) if zero_point is None else zero_point.to(device=target.device)
    _set_buffer(module, "weight_scale", scale)
    _set_buffer(module, "weight_zero_point", zero_point.to(scale.dtype))
    if g_idx is not None:
        _set_buffer(module, "weight_g_idx", g_idx.to(device=target.device, dtype=torch.int32))
    elif "weight_g_idx" in module._buffers:
        del module._buffers["weight_g_idx"]
    if global_scale is not None and args.float_format == "nvfp4":
        _set_buffer(module, "weight_global_scale", global_scale.to(device=target.device, dtype=torch.float32).reshape(1))
    else:
        module._buffers.pop("weight_global_scale", None)
    module.quantization_args = args


def replace_data(target: Tensor, values: Tensor) -> None:
    """Give ``target`` (a parameter, kept as the same object) ``values``, in its dtype, as its storage.

    Swapping storage instead of copying into it matters: a weight loaded from safetensors views a
    copy-on-write file map, and writing into it faults every page in, copying it from the file
    first (measured: 0.09 s for MiniLM's 42 MB of Linears, 30x the copy itself). Holders of the
    parameter object (tied modules, traced ``get_attr``) see the new values.
    """
    if values.data_ptr() == target.data_ptr():
        return
    old = target.data
    target.data = values.detach() if values.dtype == target.dtype else values.detach().to(target.dtype)
    release_mapped_pages(old)  # else the file's pages of the old values stay resident beside the new ones


def _set_buffer(module: nn.Module, name: str, value: Tensor) -> None:
    if name in module._buffers:
        module._buffers[name] = value.detach().clone()
    else:
        if hasattr(module, name):
            delattr(module, name)
        module.register_buffer(name, value.detach().clone(), persistent=False)


def quantized_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module of ``model`` that :func:`set_quantized_weight` quantized, by qualified name."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "quantization_args", None), QuantizationArgs)}


def clear_quantization(module: nn.Module) -> None:
    """Forget a module's qparams and input quantization (its weight keeps its current values)."""
    for name in QPARAM_NAMES:
        module._buffers.pop(name, None)
    for name in ("quantization_args", "input_quantization_args", "forward"):
        module.__dict__.pop(name, None)


def set_input_quantization(module: nn.Module, args: QuantizationArgs, scale: Tensor | None = None,
                           zero_point: Tensor | None = None, global_scale: Tensor | None = None) -> None:
    """Make ``module`` fake-quantize its input with ``args`` (static ones with ``scale`` / ``zero_point``,
    NVFP4's with its calibrated ``global_scale``, kept float32 as ``input_global_scale``)."""
    if args.strategy == "tensor_group":
        if global_scale is None:
            raise ValueError("NVFP4 input quantization needs a calibrated global input scale")
        _set_buffer(module, "input_global_scale",
                    global_scale.to(device=module.weight.device, dtype=torch.float32).reshape(1))
    elif not args.dynamic:
        if scale is None:
            raise ValueError("static input quantization needs a calibrated scale")
        device = module.weight.device
        _set_buffer(module, "input_scale", scale.to(device=device, dtype=module.weight.dtype).reshape(1))
        zero = torch.zeros_like(scale) if zero_point is None else zero_point
        _set_buffer(module, "input_zero_point", zero.to(device=device, dtype=module.weight.dtype).reshape(1))
    module.input_quantization_args = args
    module.forward = types.MethodType(_input_quantized_forward, module)


def _input_quantized_forward(self: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> Any:
    x = fake_quantize_activation(x, self.input_quantization_args, self._buffers.get("input_scale"),
                                 self._buffers.get("input_zero_point"), self._buffers.get("input_global_scale"))
    return type(self).forward(self, x, *args, **kwargs)
