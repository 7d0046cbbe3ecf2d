"""Where quantization results live on a module, for the forward pass and the saver.

After :func:`set_quantized_weight` a module carries

* ``weight``: the fake-quantized values (so the model computes as it will after reload),
* ``weight_scale`` / ``weight_zero_point`` (buffers, compressed-tensors shapes, Linear layout),
* ``weight_g_idx`` (buffer, int32) when GPTQ reordered columns into groups,
* ``weight_global_scale`` (buffer, float32, ``(1,)``) for NVFP4; the low-bit float formats keep
  ``weight_scale`` as the effective float32 block scale (see :mod:`.float_formats`), whatever the
  weight's dtype, so the saver recovers the stored FP8 / E8M0 scale bytes exactly,
* ``quantization_args``: the :class:`~layerwise.algorithms.quantization.args.QuantizationArgs` used.

Within :func:`keeping_codes` (``compress()`` with an output folder) it also keeps the weight's codes (the
integers, or float8 values, the saver stores) from the same quantization, so the saver does not divide the
weight by its scale a second time: :func:`take_weight_codes` gives them (once) while the weight and its
qparams are the ones they came from and the stored weight re-quantizes to them (:func:`codes_survive_storage`),
and the context drops those left when it ends.

After :func:`set_input_quantization` it also carries ``input_quantization_args`` (and, for static
activations, ``input_scale`` / ``input_zero_point`` buffers), and its ``forward`` fake-quantizes its
input first: the model computes as an inference server running the checkpoint will, and the
layers after it are calibrated on those quantized activations (layers reading one tensor with equal input
quantization share one fake quantization of it: :mod:`.shared_inputs`). The forward is replaced on the
instance (not a hook): it survives ``copy.deepcopy`` and is no hook for anyone to remove.

transformers' ``Conv1D`` (GPT-2) stores its weight as ``(in, out)``; everything here
takes and returns the ``nn.Linear`` layout ``(out, in)`` and transposes for you.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.int_packing import unpack_int4
from layerwise.algorithms.quantization.qmath import (
    fake_quantize_weight,
    fake_quantize_weight_with_codes,
    fake_quantize_weight_with_packed_codes,
)
from layerwise.algorithms.quantization.shared_inputs import quantized_input
from layerwise.common.mapped_pages import release_mapped_pages

QPARAM_NAMES = ("weight_scale", "weight_zero_point", "weight_g_idx", "weight_global_scale", "input_scale",
               "input_zero_point", "input_global_scale")


#: the modules whose codes are kept, inside :func:`keeping_codes` (``None`` outside)
_KEPT: ContextVar[list[nn.Module] | None] = ContextVar("layerwise_kept_codes", default=None)
#: the attribute (not a buffer: never in a state dict) holding a module's :class:`_Codes`
_CODES = "_layerwise_weight_codes"


@dataclass(frozen=True)
class _Codes:
    """A weight's codes and what they were computed from (the weight's storage and version, the qparams)."""

    values: Tensor
    data_ptr: int
    version: int
    scale: Tensor
    zero_point: Tensor
    args: QuantizationArgs
    packed: bool = False  # 4-bit codes as pack_to_int32's words


def is_transposed(module: nn.Module) -> bool:
    """Does ``module`` store its weight as ``(in, out)`` (transformers' Conv1D)?"""
    return type(module).__name__ == "Conv1D"


def linear_weight(module: nn.Module) -> Tensor:
    """The module's weight in the ``nn.Linear`` layout ``(out, in)`` (a view, not a copy)."""
    weight = module._parameters.get("weight")  # not module.weight first: nn.Module's lookup is slow (has_weight)
    if weight is None:
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
    kept = _KEPT.get()
    dtype = None if kept is None or on_grid or g_idx is not None or is_transposed(module) else codes_dtype(args)
    codes = None
    if on_grid:
        fq = weight
    elif dtype is not None and codes_survive_storage(target.dtype, args) and keeps_packed(args):
        fq, codes = fake_quantize_weight_with_packed_codes(weight, scale.to(torch.float32),
                                                           zero_point.to(torch.float32), args)
    elif dtype is not None and codes_survive_storage(target.dtype, args):
        fq, codes = fake_quantize_weight_with_codes(weight, scale.to(torch.float32), zero_point.to(torch.float32),
                                                    args, dtype)
    else:
        fq = fake_quantize_weight(weight, scale.to(torch.float32), zero_point.to(torch.float32), args, g_idx)
    replace_data(target, fq.t().contiguous() if is_transposed(module) else fq)
    set_weight_qparams(module, scale, zero_point, args, g_idx, global_scale)
    if codes is not None and kept is not None:
        module.__dict__[_CODES] = _Codes(codes, target.data_ptr(), target._version, module._buffers["weight_scale"],
                                         module._buffers["weight_zero_point"], args, keeps_packed(args))
        kept.append(module)


def codes_dtype(args: QuantizationArgs) -> torch.dtype | None:
    """The dtype that holds a weight's codes exactly: int8 for integers of up to 8 bits, float8 e4m3 for
    8-bit floats (FP8, MXFP8); ``None`` for FP4 (its values are no integers; the saver encodes them)."""
    if args.type == "int" and args.num_bits <= 8:
        return torch.int8
    if args.type == "float" and args.num_bits == 8:
        return torch.float8_e4m3fn
    return None


def keeps_packed(args: QuantizationArgs) -> bool:
    """Are a weight's kept codes packed (:func:`~.int_packing.pack_to_int32`'s words)? For 4-bit integers: packed
    slice by slice as they are computed, they are what ``pack-quantized`` stores, in half the bytes of int8
    codes, and no second pass over the weight packs them (:func:`take_weight_codes` unpacks them for other
    layouts)."""
    return args.type == "int" and args.num_bits == 4


@contextlib.contextmanager
def keeping_codes(keep: bool = True) -> Iterator[None]:
    """Inside, :func:`set_quantized_weight` keeps each weight's codes for the saver (:func:`take_weight_codes`);
    on exit they are dropped (they cost a byte a weight while kept). ``keep=False``: nothing is kept."""
    kept: list[nn.Module] | None = [] if keep else None
    token = _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.reset(token)
        for module in kept or ():
            module.__dict__.pop(_CODES, None)


def take_weight_codes(module: nn.Module) -> Tensor | None:
    """The codes :func:`set_quantized_weight` kept for ``module``'s weight (in :func:`codes_dtype`), while its
    weight, qparams and args are still the ones they came from; else ``None`` (quantize the weight). The module
    forgets them: an encoder takes them once, and their byte a weight is freed as it goes."""
    codes = _take_codes(module)
    if codes is None:
        return None
    return unpack_int4(codes.values, linear_weight(module).shape[1]) if codes.packed else codes.values


def take_packed_weight_codes(module: nn.Module) -> Tensor | None:
    """The kept codes of ``module``'s weight as :func:`~.int_packing.pack_to_int32`'s words (4-bit integers,
    :func:`keeps_packed`), taken as :func:`take_weight_codes` takes them; ``None`` (and the codes kept) when
    they were kept unpacked."""
    codes: _Codes | None = module.__dict__.get(_CODES)
    if codes is None or not codes.packed:
        return None
    codes = _take_codes(module)
    return None if codes is None else codes.values


def _take_codes(module: nn.Module) -> _Codes | None:
    """The module's kept codes, forgotten by it, if its weight, qparams and args are still theirs."""
    codes: _Codes | None = module.__dict__.pop(_CODES, None)
    if codes is None:
        return None
    weight = module.weight
    same = (weight.data_ptr() == codes.data_ptr and weight._version == codes.version
            and module._buffers.get("weight_scale") is codes.scale
            and module._buffers.get("weight_zero_point") is codes.zero_point
            and getattr(module, "quantization_args", None) is codes.args and "weight_g_idx" not in module._buffers)
    return codes if same else None


def codes_survive_storage(dtype: torch.dtype, args: QuantizationArgs) -> bool:
    """Does a fake-quantized weight stored in ``dtype`` re-quantize to the very codes it came from?

    The in-memory run keeps ``(q - z) * scale`` rounded to the weight's dtype and the saver quantizes that
    again. Rounding to ``p`` significant bits moves a value by at most ``2**-p`` of it, so the code comes
    back when ``|q - z| < 2**(p - 1)``: integers up to 8 bits symmetric (``|q| <= 127``; -128 is exact) or
    up to 7 bits asymmetric in bfloat16, every integer scheme in float16 and float32, and the float
    formats (their grids are far coarser than the rounding). int8 asymmetric in bfloat16 is the
    exception (``|q - z|`` reaches 255): some codes move by one step there, so that case keeps the
    in-memory run's steps to give its bytes.
    """
    if args.type == "float" or not dtype.is_floating_point:
        return True
    significant = 1 - int(math.log2(torch.finfo(dtype).eps))
    span = (1 << (args.num_bits - 1)) - 1 if args.symmetric else (1 << args.num_bits) - 1
    return span < 1 << (significant - 1)


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
    module.__dict__.pop(_CODES, None)  # codes of earlier qparams


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
    for name in ("quantization_args", "input_quantization_args", "forward", _CODES):
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
    x = quantized_input(x, self.input_quantization_args, self._buffers.get("input_scale"),
                        self._buffers.get("input_zero_point"), self._buffers.get("input_global_scale"))
    return type(self).forward(self, x, *args, **kwargs)
