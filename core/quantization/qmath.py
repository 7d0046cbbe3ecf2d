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
``group`` -> ``(out, in // group_size)``. Weights are in the ``nn.Linear`` layout
``(out_features, in_features)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .args import QuantizationArgs

Observer = Callable[[Tensor], "tuple[Tensor, Tensor]"]


def qrange(args: QuantizationArgs) -> tuple[int, int]:
    """The signed integer range: ``(-2**(b-1), 2**(b-1) - 1)``."""
    return -(1 << (args.num_bits - 1)), (1 << (args.num_bits - 1)) - 1


def compute_qparams(min_val: Tensor, max_val: Tensor, args: QuantizationArgs) -> tuple[Tensor, Tensor]:
    """Scale and zero point, elementwise, from observed minima and maxima."""
    min_val = torch.minimum(min_val, torch.zeros_like(min_val))
    max_val = torch.maximum(max_val, torch.zeros_like(max_val))
    qmin, qmax = qrange(args)
    span = float(qmax - qmin)
    if args.symmetric:
        scale = torch.maximum(min_val.abs(), max_val.abs()) / (span / 2)
    else:
        scale = (max_val - min_val) / span
    eps = torch.finfo(scale.dtype).eps if scale.is_floating_point() else 1e-8
    scale = torch.where(scale == 0, torch.full_like(scale, eps), scale)
    if args.symmetric:
        zero_point = torch.zeros_like(scale)
    else:
        zero_point = torch.round(torch.clamp(qmin - min_val / scale, qmin, qmax))
    return scale, zero_point


def quantize(x: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs) -> Tensor:
    """Integer values (in ``x``'s floating dtype) of ``x``; ``scale``/``zero_point`` broadcast."""
    qmin, qmax = qrange(args)
    scaled = x / scale
    if zero_point is not None:
        scaled = scaled + zero_point.to(scaled.dtype)
    return torch.clamp(torch.round(scaled), qmin, qmax)


def dequantize(q: Tensor, scale: Tensor, zero_point: Tensor | None = None) -> Tensor:
    """``(q - zero_point) * scale`` in the scale's dtype."""
    values = q.to(scale.dtype)
    if zero_point is not None:
        values = values - zero_point.to(scale.dtype)
    return values * scale


def fake_quantize(x: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs) -> Tensor:
    """Quantize then dequantize (the values the compressed model computes with)."""
    return dequantize(quantize(x, scale, zero_point, args), scale, zero_point).to(x.dtype)


# -- weights ------------------------------------------------------------------------------
def _check_weight(weight: Tensor, args: QuantizationArgs) -> None:
    if weight.ndim != 2:
        raise ValueError(f"weight quantization expects a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
    if args.strategy == "group" and weight.shape[1] % args.group_size:
        raise ValueError(f"group_size {args.group_size} does not divide in_features {weight.shape[1]}; "
                         f"use strategy 'channel' or a group size that divides {weight.shape[1]}")


def weight_min_max(weight: Tensor, args: QuantizationArgs) -> tuple[Tensor, Tensor]:
    """Minima and maxima of ``weight`` reduced to the qparam shape of ``args.strategy``."""
    _check_weight(weight, args)
    w = weight.detach()
    if args.strategy == "tensor":
        return w.amin().reshape(1), w.amax().reshape(1)
    if args.strategy == "channel":
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    grouped = w.reshape(w.shape[0], w.shape[1] // args.group_size, args.group_size)
    return grouped.amin(dim=-1), grouped.amax(dim=-1)


def weight_qparams(weight: Tensor, args: QuantizationArgs, observer: Observer | Any = None) -> tuple[Tensor, Tensor]:
    """Scale and zero point of a ``(out, in)`` weight, shaped as compressed-tensors stores them.

    ``observer`` is a callable ``observer(weight) -> (min_vals, max_vals)`` returning
    the reduced ranges (e.g. a registered observer instance); ``None`` means min-max.
    """
    _check_weight(weight, args)
    min_val, max_val = observer(weight) if observer is not None else weight_min_max(weight, args)
    return compute_qparams(min_val, max_val, args)


def default_g_idx(in_features: int, group_size: int, device: torch.device | None = None) -> Tensor:
    """Group index of each input column without activation reordering: ``j // group_size``."""
    return torch.arange(in_features, device=device, dtype=torch.int32) // group_size


def expand_qparams(weight: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs,
                   g_idx: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """Scale and zero point broadcastable elementwise against ``weight`` (group -> per column)."""
    if args.strategy != "group":
        return scale, zero_point
    _check_weight(weight, args)
    if g_idx is None:
        g_idx = default_g_idx(weight.shape[1], args.group_size, weight.device)
    g_idx = g_idx.to(device=scale.device, dtype=torch.long)
    return scale[:, g_idx], (zero_point[:, g_idx] if zero_point is not None else None)


def quantize_weight(weight: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs,
                    g_idx: Tensor | None = None) -> Tensor:
    """Integer values of a ``(out, in)`` weight (floating dtype); group columns use ``g_idx``."""
    s, z = expand_qparams(weight, scale, zero_point, args, g_idx)
    return quantize(weight, s, z, args)


def fake_quantize_weight(weight: Tensor, scale: Tensor, zero_point: Tensor | None, args: QuantizationArgs,
                         g_idx: Tensor | None = None) -> Tensor:
    """Fake-quantized ``(out, in)`` weight; with ``group``, column ``j`` uses group ``g_idx[j]``
    (default ``j // group_size``)."""
    s, z = expand_qparams(weight, scale, zero_point, args, g_idx)
    return fake_quantize(weight, s, z, args)
