"""Integer quantization arithmetic, with the compressed-tensors conventions.

Semantics (the same as compressed-tensors, so transformers' loader reproduces the
weights bit for bit)::

    q  = clamp(round(x / scale + zero_point), qmin, qmax)     # round half to even
    x' = (q - zero_point) * scale

* signed integer ranges: int4 ``[-8, 7]``, int8 ``[-128, 127]``;
* the observed range always contains 0 (``min <= 0 <= max``) so that 0 is exact;
* symmetric: ``scale = max(|min|, |max|) / ((qmax - qmin) / 2)`` (7.5 for int4,
  127.5 for int8 -- the compressed-tensors / llm-compressor choice: the extreme
  positive value clips by at most half a step, the negative end is used fully);
  ``zero_point = 0``;
* asymmetric: ``scale = (max - min) / (qmax - qmin)``,
  ``zero_point = round(clamp(qmin - min / scale, qmin, qmax))``;
* a zero scale (an all-zero range) becomes the dtype's machine epsilon, so
  ``scale > 0`` always.

Zero points are returned as floating tensors holding integers (same dtype as the
scale); the saver casts them to int8.

Shapes follow compressed-tensors: ``tensor`` -> ``(1,)``, ``channel`` -> ``(out, 1)``,
``group`` -> ``(out, in // group_size)``, ``block`` -> ``(ceil(out / rows), ceil(in / cols))``.
Weights are in the ``nn.Linear`` layout ``(out_features, in_features)``.

float8 (``type: float``): e4m3, symmetric, ``scale = max|x| / 448`` (448 is the largest e4m3
value); ``q = float8(clamp(x / scale, -448, 448))`` (the cast rounds to the nearest e4m3 value),
``x' = q * scale``.

The low-bit float formats (``args.float_format``: NVFP4, MXFP4, MXFP8; definitions and why the scales
are what they are in :mod:`.float_formats`): ``scale`` is the effective float32 scale of each block
(``2**e`` for MX, ``s8 / global_scale`` for NVFP4), ``q`` the FP4 E2M1 (or FP8 E4M3) value of
``x / scale`` (nearest, ties to even, saturating), ``x' = q * scale``. NVFP4 block scales need the
tensor's global scale: :func:`weight_global_scale` (one for several tensors when they are fused).

Activations (a layer's input, last dimension = channels): ``token`` -> one scale per row,
``group`` -> one per ``group_size`` channels of each row, ``tensor`` -> one; dynamic ones are
computed from each input, static ones calibrated once.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.float_formats import (
    FP4_MAX,
    NVFP4_BLOCK,
    fake_quantize_nvfp4,
    float8_grid,
    fp4_grid,
    mx_scale,
    nvfp4_global_scale,
    nvfp4_scale,
)
from layerwise.algorithms.quantization.int_packing import pack_to_int32
from layerwise.algorithms.quantization.slices import by_row_slices, cast_results

Observer = Callable[[Tensor], "tuple[Tensor, Tensor]"]

#: the largest float8 e4m3 value
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
#: the half-precision dtypes compressed-tensors quantizes a layer's input in (itself, not float32)
LOW_PRECISION = (torch.bfloat16, torch.float16)


def qrange(args: QuantizationArgs) -> tuple[float, float]:
    """The representable range: ``(-2**(b-1), 2**(b-1) - 1)`` for integers, ``(-448, 448)`` for float8,
    ``(-6, 6)`` for fp4."""
    if args.type == "float":
        return (-FP4_MAX, FP4_MAX) if args.num_bits == 4 else (-FP8_MAX, FP8_MAX)
    return -(1 << (args.num_bits - 1)), (1 << (args.num_bits - 1)) - 1


def compute_qparams(min_val: Tensor, max_val: Tensor, args: QuantizationArgs,
                    global_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Scale and zero point, elementwise, from observed minima and maxima; NVFP4 (``tensor_group``) block
    scales are relative to the tensor's ``global_scale`` (:func:`weight_global_scale`)."""
    if args.float_format is not None:
        amax = torch.maximum(min_val.abs(), max_val.abs())
        if args.float_format == "nvfp4":
            if global_scale is None:
                raise ValueError("NVFP4 block scales are relative to the tensor's global scale: pass global_scale "
                                 "(qmath.weight_global_scale of the weight, or of the fused q/k/v or gate/up weights)")
            scale = nvfp4_scale(amax, global_scale)
        else:
            scale = mx_scale(amax, args.num_bits)
        return scale, torch.zeros_like(scale)
    return integer_qparams(min_val, max_val, args)


def integer_qparams(min_val: Tensor, max_val: Tensor, args: QuantizationArgs,
                    rounding: Callable[[Tensor], Tensor] = torch.round) -> tuple[Tensor, Tensor]:
    """An integer grid's scale and zero point from ranges (widened to include 0; a zero scale becomes eps);
    ``rounding`` rounds the zero point (AutoRound passes a straight-through one to learn the ranges)."""
    min_val = torch.minimum(min_val, torch.zeros_like(min_val))
    max_val = torch.maximum(max_val, torch.zeros_like(max_val))
    qmin, qmax = qrange(args)
    span = float(qmax - qmin)
    if args.symmetric:
        scale = torch.maximum(min_val.abs(), max_val.abs()) / _divisor(span / 2, min_val)
    else:
        scale = (max_val - min_val) / _divisor(span, min_val)
    eps = torch.finfo(scale.dtype).eps if scale.is_floating_point() else 1e-8
    scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
    if args.symmetric:
        zero_point = torch.zeros_like(scale)
    else:
        zero_point = rounding(torch.clamp(qmin - min_val / scale, qmin, qmax))
    return scale, zero_point


def _divisor(value: float, like: Tensor) -> float | Tensor:
    """``value`` to divide ``like`` by: in bfloat16 / float16 a tensor of that dtype on its device, as
    compressed-tensors divides (CUDA turns a number divisor into a product with its float32 reciprocal, which
    can round a bfloat16 quotient the other way); the number itself otherwise (float32 as it always was)."""
    if like.dtype in LOW_PRECISION:
        return torch.tensor(value, dtype=like.dtype, device=like.device)
    return value


def quantize(x: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs) -> Tensor:
    """Integer values (in ``x``'s floating dtype) of ``x``; ``scale``/``zero_point`` broadcast."""
    qmin, qmax = qrange(args)
    scaled = x / scale  # a fresh tensor: the steps below work in place (one pass each, no copies)
    if args.type == "float":
        return float8_grid(scaled.clamp_(qmin, qmax)) if args.num_bits == 8 else fp4_grid(scaled.clamp_(qmin, qmax))
    if zero_point is not None and not args.symmetric:  # a symmetric zero point is 0
        scaled.add_(zero_point.to(scaled.dtype))
    return scaled.round_().clamp_(qmin, qmax)


def dequantize(q: Tensor, scale: Tensor, zero_point: Tensor | None = None) -> Tensor:
    """``(q - zero_point) * scale`` in the scale's dtype."""
    values = q.to(scale.dtype)
    if zero_point is not None:
        values = values - zero_point.to(scale.dtype)
    return values * scale


def fake_quantize(x: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs, *,
                  cast: bool = True) -> Tensor:
    """Quantize then dequantize (the values the compressed model computes with), in ``x``'s dtype (``cast``) or
    in the computation's (float32 for a float32 scale: the caller casts them as it stores them)."""
    return _dequantize_in_place(quantize(x, scale, zero_point, args), scale, zero_point, args,
                                x.dtype if cast else None)


def fake_quantize_with_codes(x: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs,
                             codes_dtype: torch.dtype, *, cast: bool = True) -> tuple[Tensor, Tensor]:
    """:func:`fake_quantize`'s values (``cast`` as there) and the integer values of ``x`` in ``codes_dtype`` (one
    that holds them exactly: int8, float8), from one quantization."""
    if args.type == "float" and args.num_bits == 8:  # the float8 cast gives the codes: made once, not twice
        scaled = (x / scale).clamp_(*qrange(args))
        codes = scaled.to(torch.float8_e4m3fn)
        q = float8_grid(scaled, codes)
    else:
        q = quantize(x, scale, zero_point, args)
        codes = q.to(codes_dtype)
    return _dequantize_in_place(q, scale, zero_point, args, x.dtype if cast else None), codes


def _dequantize_in_place(q: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs,
                         dtype: torch.dtype | None) -> Tensor:
    """``(q - zero_point) * scale`` in ``dtype`` (``None``: the scale's), computed in ``q`` itself when it has
    the scale's dtype."""
    if q.dtype != scale.dtype:
        values = dequantize(q, scale, zero_point)
    else:
        if zero_point is not None and not args.symmetric:
            q.sub_(zero_point.to(q.dtype))
        values = q.mul_(scale)
    return values if dtype is None else values.to(dtype)


# -- weights ------------------------------------------------------------------------------
def _check_weight(weight: Tensor, args: QuantizationArgs) -> None:
    if weight.ndim != 2:
        raise ValueError(f"weight quantization expects a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
    if args.strategy in ("token",):
        raise ValueError("strategy 'token' is for activations, not weights")
    if args.float_format is not None and weight.shape[1] % args.group_size:
        raise ValueError(f"{args.float_format.upper()} scales blocks of {args.group_size} input columns, which do not "
                         f"divide in_features {weight.shape[1]}; leave this layer unquantized (ignore) or use "
                         f"an integer scheme")
    if args.strategy == "group" and weight.shape[1] % args.group_size:
        raise ValueError(f"group_size {args.group_size} does not divide in_features {weight.shape[1]}; "
                         f"use strategy 'channel' or a group size that divides {weight.shape[1]}")


def weight_min_max(weight: Tensor, args: QuantizationArgs) -> tuple[Tensor, Tensor]:
    """Minima and maxima of ``weight`` reduced to the qparam shape of ``args.strategy``."""
    _check_weight(weight, args)
    w = weight.detach()
    if args.strategy == "tensor":
        low, high = torch.aminmax(w)
        return low.reshape(1), high.reshape(1)
    # amin and amax apart, not aminmax(dim=...): on the CPU the fused kernel with a dim is 5-6x slower
    # (12 ms against 2 ms over MiniLM's Linears); without a dim it is the faster one
    if args.strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if args.strategy == "block":
        tiles = _tiles(w, args.block_structure)
        return tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    groups = w.reshape(w.shape[0], w.shape[1] // args.group_size, args.group_size)
    if w.dtype == torch.float64 or w.device.type != "cpu":
        return groups.amin(dim=-1), groups.amax(dim=-1)
    # on the CPU in float32 slices of rows, then back to the weight's dtype (exact: minima and maxima are its
    # values): a bfloat16 reduction over groups of 32 is 3x slower (65 ms against 18 ms on a 8192 x 2048 weight)
    low, high = by_row_slices(_float32_group_min_max, groups)
    return low.to(w.dtype), high.to(w.dtype)


def _float32_group_min_max(groups: Tensor) -> tuple[Tensor, Tensor]:
    values = groups.to(torch.float32)
    return values.amin(dim=-1), values.amax(dim=-1)


def weight_qparams(weight: Tensor, args: QuantizationArgs, observer: Observer | Any = None,
                   global_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Scale and zero point of a ``(out, in)`` weight, shaped as compressed-tensors stores them.

    ``observer`` is a callable ``observer(weight) -> (min_vals, max_vals)`` returning
    the reduced ranges (e.g. a registered observer instance); ``None`` means min-max.
    NVFP4 takes ``global_scale`` (default: the weight's own, :func:`weight_global_scale`), computed before the
    observer runs and passed to it too (``observer(weight, global_scale=...)``): an MSE search measures each
    block's error with the block scales relative to it.
    """
    _check_weight(weight, args)
    if args.float_format == "nvfp4" and global_scale is None:
        global_scale = weight_global_scale(weight, args)
    if observer is None:
        min_val, max_val = weight_min_max(weight, args)
    elif global_scale is None:
        min_val, max_val = observer(weight)
    else:
        min_val, max_val = observer(weight, global_scale=global_scale)
    return compute_qparams(min_val, max_val, args, global_scale)


def weight_global_scale(weights: Tensor | list[Tensor], args: QuantizationArgs) -> Tensor | None:
    """NVFP4's float32 global scale (shape ``(1,)``) for one weight, or one shared by several (the q/k/v or
    gate/up projections vLLM fuses: the largest magnitude of them all); ``None`` for other formats."""
    if args.float_format != "nvfp4":
        return None
    tensors = [weights] if isinstance(weights, Tensor) else list(weights)
    amax = torch.stack([t.detach().abs().amax().to(torch.float32) for t in tensors]).amax()
    return nvfp4_global_scale(amax)


def default_g_idx(in_features: int, group_size: int, device: torch.device | None = None) -> Tensor:
    """Group index of each input column without activation reordering: ``j // group_size``."""
    return torch.arange(in_features, device=device, dtype=torch.int32) // group_size


def _tiles(w: Tensor, block: tuple[int, int]) -> Tensor:
    """``w`` as ``(row tiles, rows, column tiles, columns)``, zero-padded at the ends (zeros never widen a
    range that always contains 0)."""
    rows, cols = block
    padded = torch.nn.functional.pad(w, (0, -w.shape[1] % cols, 0, -w.shape[0] % rows))
    return padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols)


def _untile(values: Tensor, block: tuple[int, int], shape: torch.Size) -> Tensor:
    """Per-tile ``values`` repeated over their tiles, cropped to ``shape``."""
    rows, cols = block
    return values.repeat_interleave(rows, dim=0).repeat_interleave(cols, dim=1)[:shape[0], :shape[1]]


def expand_qparams(weight: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs,
                   g_idx: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Scale and zero point broadcastable elementwise against ``weight`` (group -> per column,
    block -> per element)."""
    if args.strategy == "block":
        return (_untile(scale, args.block_structure, weight.shape),
                None if zero_point is None else _untile(zero_point, args.block_structure, weight.shape))
    if args.strategy not in ("group", "tensor_group"):
        return scale, zero_point
    _check_weight(weight, args)
    if g_idx is None:  # groups in order: a repeat, 3x faster than the gather below on the CPU (same values)
        return (scale.repeat_interleave(args.group_size, dim=1),
                None if zero_point is None else zero_point.repeat_interleave(args.group_size, dim=1))
    g_idx = g_idx.to(device=scale.device, dtype=torch.long)
    return scale[:, g_idx], (zero_point[:, g_idx] if zero_point is not None else None)


def quantize_weight(weight: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs,
                    g_idx: Tensor | None = None) -> Tensor:
    """Integer values of a ``(out, in)`` weight (floating dtype); group columns use ``g_idx``."""
    return _weight_operation(quantize, weight, scale, zero_point, args, g_idx)


def fake_quantize_weight(weight: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs,
                         g_idx: Tensor | None = None) -> Tensor:
    """Fake-quantized ``(out, in)`` weight; with ``group``, column ``j`` uses group ``g_idx[j]``
    (default ``j // group_size``)."""
    return _weight_operation(functools.partial(fake_quantize, cast=False), weight, scale, zero_point, args, g_idx,
                             (weight.dtype,))


def fake_quantize_weight_with_codes(weight: Tensor, scale: Tensor, zero_point: Tensor | None,
                                    args: QuantizationArgs, codes_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """:func:`fake_quantize_weight` (groups in order) and :func:`quantize_weight`'s values in ``codes_dtype``,
    from one quantization of the weight instead of two."""
    return _weight_operation(functools.partial(fake_quantize_with_codes, codes_dtype=codes_dtype, cast=False), weight,
                             scale, zero_point, args, None, (weight.dtype, None))


def fake_quantize_weight_with_packed_codes(weight: Tensor, scale: Tensor, zero_point: Tensor | None,
                                           args: QuantizationArgs) -> tuple[Tensor, Tensor]:
    """:func:`fake_quantize_weight_with_codes` of an integer weight with its int8 codes packed as
    :func:`~.int_packing.pack_to_int32` packs them (int32 words, ``(out, words)``): each slice of rows packed while
    its codes are in the cache, so no int8 tensor of the weight's size is written and read again (packing works
    row by row: the same words as packing the whole weight). 4-bit codes in rows of whole words are packed from
    their float32 values directly (a pair's byte is ``(a + 8) + 16 (b + 8)``), others through the int8 codes."""
    columns = weight.shape[1]

    def quantize_and_pack(x: Tensor, s: Tensor, z: Tensor | None, args: QuantizationArgs) -> tuple[Tensor, Tensor]:
        q = quantize(x, s, z, args)
        if args.num_bits == 4 and columns % 8 == 0 and sys.byteorder == "little":
            # the packed byte of a pair of codes a, b is (a + 8) + 16 (b + 8), exact in float32; eight codes a word
            pairs = q.reshape(-1, columns // 2, 2)
            packed = torch.add(pairs[..., 0], pairs[..., 1], alpha=16).add_(136).to(torch.uint8).view(torch.int32)
        else:
            packed = pack_to_int32(q.reshape(-1, columns).to(torch.int8), args.num_bits)
        return _dequantize_in_place(q, s, z, args, None), packed

    return _weight_operation(quantize_and_pack, weight, scale, zero_point, args, None, (weight.dtype, None))


def _weight_operation(operation: Callable, weight: Tensor, scale: Tensor, zero_point: Tensor | None,
                      args: QuantizationArgs, g_idx: Tensor | None,
                      dtypes: tuple[torch.dtype | None, ...] | None = None) -> Any:
    """``operation(x, scale, zero_point, args)`` on a whole weight, its qparams broadcast to it: groups in order
    as ``(out, groups, group_size)`` blocks with a scale per block (the same values as :func:`expand_qparams`'s
    per-column scales, without building them), reordered groups and tiles through the expanded qparams; on
    the CPU in slices of rows (:mod:`.slices`). ``dtypes``: each result's dtype, cast as it is stored."""
    if g_idx is None and args.strategy in ("group", "tensor_group"):
        _check_weight(weight, args)
        rows, columns = weight.shape
        blocks = weight.reshape(rows, columns // args.group_size, args.group_size)
        zero_point = None if zero_point is None or args.symmetric else zero_point.unsqueeze(-1)
        result = by_row_slices(lambda x, s, z: operation(x, s, z, args), blocks, scale.unsqueeze(-1), zero_point,
                               dtypes=dtypes)
        if isinstance(result, tuple):  # the values and codes, or packed codes: each as rows
            return tuple(r.reshape(rows, -1) for r in result)
        return result.reshape(rows, columns)
    if args.strategy in ("channel", "tensor"):
        return by_row_slices(lambda x, s, z: operation(x, s, z, args), weight, scale, zero_point, dtypes=dtypes)
    s, z = expand_qparams(weight, scale, zero_point, args, g_idx)
    return cast_results(operation(weight, s, z, args), dtypes)


# -- activations --------------------------------------------------------------------------
def activation_min_max(x: Tensor, args: QuantizationArgs) -> tuple[Tensor, Tensor]:
    """Minima and maxima of an activation ``(..., channels)`` per ``args.strategy`` (token / group / tensor);
    group results have shape ``(..., channels // group_size, 1)``."""
    if args.strategy == "token":
        return x.amin(dim=-1, keepdim=True), x.amax(dim=-1, keepdim=True)
    if args.strategy == "group" or (args.strategy == "tensor_group" and args.dynamic):
        grouped = _activation_groups(x, args.group_size)
        return grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
    low, high = torch.aminmax(x)  # one pass; and NVFP4's global range, calibrated
    return low.reshape(1), high.reshape(1)


def _activation_groups(x: Tensor, group_size: int) -> Tensor:
    if x.shape[-1] % group_size:
        raise ValueError(f"activation group_size {group_size} does not divide the {x.shape[-1]} input channels")
    return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)


def activation_dtype(x: Tensor, args: QuantizationArgs) -> torch.dtype:
    """The dtype input ``x`` is quantized in: a bfloat16 / float16 input's own for the integer and FP8 grids,
    as compressed-tensors (transformers' loader) quantizes it (its range, scale, quotient and product each
    rounded to that dtype), so a reloaded half-precision model computes the in-memory model's values; float32
    otherwise. MX and NVFP4 stay float32: MX's power-of-two scales make every step exact in either dtype, and
    NVFP4 follows vLLM's float32 block scales (GUIDE.md, the low-bit float formats)."""
    return x.dtype if x.dtype in LOW_PRECISION and args.float_format is None else torch.float32


def fake_quantize_activation(x: Tensor, args: QuantizationArgs, scale: Tensor | None = None,
                             zero_point: Tensor | None = None, global_scale: Tensor | None = None) -> Tensor:
    """The values a quantized layer computes with for input ``x`` (in :func:`activation_dtype`): dynamic args
    take their scales from ``x`` itself, static ones use the calibrated ``scale`` / ``zero_point`` (per
    tensor); NVFP4's block scales are dynamic, relative to the calibrated ``global_scale``."""
    dtype = activation_dtype(x, args)
    values = x.to(dtype)  # x itself in its own dtype: every step below writes a fresh tensor first
    if args.dynamic:
        if args.strategy == "tensor_group" and global_scale is None:
            raise ValueError("NVFP4 input quantization needs the calibrated global input scale")
        if args.float_format == "nvfp4" and args.group_size == NVFP4_BLOCK:  # the same values in fewer passes
            return fake_quantize_nvfp4(values, global_scale).to(x.dtype)
        scale, zero_point = compute_qparams(*activation_min_max(values, args), args, global_scale)
    elif scale is None:
        raise ValueError("static activation quantization needs a calibrated scale")
    else:
        scale = scale.to(dtype)
        zero_point = None if zero_point is None else zero_point.to(dtype)
    if args.strategy in ("group", "tensor_group"):
        grouped = fake_quantize(_activation_groups(values, args.group_size), scale, zero_point, args)
        return grouped.reshape(x.shape).to(x.dtype)
    return fake_quantize(values, scale, zero_point, args).to(x.dtype)
