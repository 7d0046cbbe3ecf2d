"""AWQ's scale search: per-input-channel scales that shield the channels activations use most.

Multiplying a weight's input column ``j`` by ``s[j] > 1`` before round-to-nearest shrinks that
column's relative rounding error by about ``s[j]`` (the group's step barely moves when one column
grows); dividing the layer's input by ``s`` (folded into the module that produces it, see
:mod:`.smoothing`) keeps the function. AWQ picks ``s`` from the inputs' mean magnitude:

* a candidate for ``alpha`` in ``{0, 1/n, ..., (n-1)/n}`` is ``s = x_mean ** alpha``, or with
  duo scaling ``s = x_mean ** alpha / w_mean ** (1 - alpha)``, where ``w_mean[j]`` is the mean over
  output rows of ``|W[:, j]|`` divided by the largest ``|W|`` of its quantization group (row for
  ``channel``, the whole tensor for ``tensor``); ``s`` is then divided by ``sqrt(max(s) * min(s))``
  so that it straddles 1;
* each candidate is scored by the layers' output error on sample inputs ``X``:
  ``sum over layers of mean((X W^T - X W'^T) ** 2)`` with ``W' = Q(W * s) / s``;
* ``s = 1`` (plain round-to-nearest) is scored first and kept unless a candidate is strictly
  better, so the chosen scales never do worse than RTN on the sample.

Pure functions on tensors; hooks, mappings and storage are the modifier's
(``layerwise.plugins.modifiers.awq``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import (
    expand_qparams,
    fake_quantize_weight,
    weight_min_max,
    weight_qparams,
)

#: floor of the statistics a scale is raised to a power of (a channel never seen non-zero)
TINY = 1e-4


@dataclass(frozen=True)
class ScaleSearch:
    """The outcome of :func:`search_scales` for one group of layers sharing an input."""

    #: the chosen per-input-channel scales (all ones when round-to-nearest won)
    scales: Tensor
    #: the grid point chosen, ``None`` when no candidate beat ``s = 1``
    alpha: float | None
    #: output error with the chosen scales, and with ``s = 1`` (plain round-to-nearest)
    loss: float
    rtn_loss: float
    #: output error of every grid point, in grid order
    losses: tuple[float, ...]


def weight_mean(weights: Sequence[Tensor], args: QuantizationArgs) -> Tensor:
    """Per input column: mean over every layer's rows of ``|W|`` relative to the largest ``|W|`` of
    its quantization group, so that the weights' own outliers count as the quantizer sees them."""
    parts = []
    for weight in weights:
        magnitude = weight.detach().abs().to(torch.float32)
        _, group_max = weight_min_max(magnitude, args)  # per group, shaped as the scales are
        group_max, _ = expand_qparams(magnitude, group_max.clamp(min=TINY), None, args)
        parts.append(magnitude / group_max)
    return torch.cat(parts).mean(dim=0)


def candidate_scales(x_mean: Tensor, w_mean: Tensor | None, alpha: float) -> Tensor:
    """``x_mean ** alpha`` (divided by ``w_mean ** (1 - alpha)`` when given), centred on 1 geometrically."""
    scales = x_mean.to(torch.float32).clamp(min=TINY).pow(alpha)
    if w_mean is not None:
        scales = scales / w_mean.to(torch.float32).clamp(min=TINY).pow(1 - alpha)
    return (scales / (scales.max() * scales.min()).sqrt()).clamp(min=TINY)


def rtn_weight(weight: Tensor, args: QuantizationArgs, observer: Any = None) -> Tensor:
    """Round-to-nearest fake-quantized ``weight`` with ``args`` (qparams from ``observer``, else min-max)."""
    scale, zero_point = weight_qparams(weight, args, observer)
    return fake_quantize_weight(weight, scale, zero_point, args)


def output_loss(rows: Tensor, weights: Sequence[Tensor], scales: Tensor, args: QuantizationArgs,
                observer: Any = None) -> float:
    """``sum over layers of mean((X W^T - X W'^T) ** 2)``, ``W' = Q(W * s) / s``, ``X`` = ``rows``."""
    total = 0.0
    for weight in weights:
        quantized = rtn_weight(weight * scales, args, observer) / scales
        error = rows @ (weight - quantized).t()
        total += float(error.square().mean())
    return total


def search_scales(rows: Tensor, x_mean: Tensor, weights: Sequence[Tensor], args: QuantizationArgs, *,
                  n_grid: int = 20, duo_scaling: bool = True, observer: Any = None) -> ScaleSearch:
    """The best of ``s = 1`` and the ``n_grid`` candidates by output error on ``rows`` (module docstring).

    ``rows``: ``(tokens, in)`` sample inputs; ``x_mean``: ``(in,)`` mean ``|x|`` over every token;
    ``weights``: the ``(out, in)`` float32 weights of the layers reading that input.
    """
    if n_grid < 1:
        raise ValueError(f"n_grid must be at least 1, got {n_grid}")
    ones = torch.ones_like(x_mean, dtype=torch.float32)
    rtn_loss = output_loss(rows, weights, ones, args, observer)
    best_loss, best_scales, best_alpha = rtn_loss, ones, None
    w_mean = weight_mean(weights, args) if duo_scaling else None
    losses = []
    for step in range(n_grid):
        alpha = step / n_grid
        scales = candidate_scales(x_mean, w_mean, alpha)
        loss = output_loss(rows, weights, scales, args, observer)
        losses.append(loss)
        if loss < best_loss and math.isfinite(loss):
            best_loss, best_scales, best_alpha = loss, scales, alpha
    return ScaleSearch(best_scales, best_alpha, best_loss, rtn_loss, tuple(losses))


def search_flops(tokens: int, weights: Sequence[Tensor], n_grid: int) -> float:
    """Floating-point operations of :func:`search_scales`' matrix products (the rest is elementwise)."""
    per_candidate = sum(2.0 * tokens * w.shape[0] * w.shape[1] for w in weights)
    return per_candidate * (n_grid + 1)
