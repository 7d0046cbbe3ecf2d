"""Elementwise work on the CPU in slices of rows small enough to stay in the cache.

Quantizing a weight is a chain of elementwise steps (divide, round, clamp, multiply, cast), and each
torch call reads and writes the whole tensor. A large weight does not fit in the CPU's cache, so ten
steps are ten trips through memory; run on a slice of about :data:`SLICE_ELEMENTS` elements, each step
reads what the step before left in the cache (3x faster on a 2048 x 8192 weight, the same values since
every step is elementwise). On a GPU one call over the whole tensor is faster, so nothing is sliced.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

#: elements per slice (256 KiB of float32): a few slices fit in a core's L2 cache
SLICE_ELEMENTS = 1 << 16
#: elements per slice of a layer's input quantized at run time (1 MiB of float32): each slice runs about twenty
#: torch calls, so smaller slices pay more in calls than they save in memory traffic (an NVFP4 input of
#: 512 x 1024: 1.9 ms in slices of this size, 2.3 ms in slices of 64 Ki elements, 2.0 ms whole; one thread)
INPUT_SLICE_ELEMENTS = 1 << 18


def by_row_slices(function: Callable[..., Any], x: Tensor, *per_row: Tensor | None,
                  dtypes: tuple[torch.dtype | None, ...] | None = None) -> Any:
    """``function(x[a:b], *(p[a:b] for p in per_row))`` over slices of ``x``'s rows, joined into one tensor
    (or, for a ``function`` returning a tuple of tensors, one tensor for each).

    An argument of ``per_row`` with as many rows as ``x`` is sliced with it; any other (a scalar scale,
    ``None``) is passed whole to every call. ``function`` must work row by row (elementwise, or along
    the other dimensions only). Off the CPU, or for a tensor of one slice, it is a single call.
    ``dtypes``: each joined tensor's dtype (``None``: its slices'); a slice is cast as it is written into its
    place, one pass where a cast in ``function`` and the write would be two.
    """
    parts = row_slices(x) if x.ndim else []
    if len(parts) < 2:
        return cast_results(function(x, *per_row), dtypes)
    rows = x.shape[0]

    def part(rows_of: slice) -> Tensor:
        return function(x[rows_of], *(_rows(p, rows_of.start, rows_of.stop, rows) for p in per_row))

    first = part(parts[0])
    several = isinstance(first, tuple)
    wanted = dtypes or (None,) * (len(first) if several else 1)
    outs = tuple(torch.empty((rows, *f.shape[1:]), dtype=dtype or f.dtype)
                 for f, dtype in zip(first if several else (first,), wanted))
    for index, rows_of in enumerate(parts):
        results = first if index == 0 else part(rows_of)
        for out, result in zip(outs, results if several else (results,)):
            out[rows_of] = result
    return outs if several else outs[0]


def cast_results(result: Any, dtypes: tuple[torch.dtype | None, ...] | None) -> Any:
    """``result`` (a tensor or a tuple of them) with each tensor in its dtype of ``dtypes`` (``None``: as it is)."""
    if dtypes is None:
        return result
    several = isinstance(result, tuple)
    cast = tuple(r if dtype is None else r.to(dtype) for r, dtype in zip(result if several else (result,), dtypes))
    return cast if several else cast[0]


def row_slices(x: Tensor, elements: int = SLICE_ELEMENTS) -> list[slice]:
    """The rows (first dimension) of ``x`` in slices of about ``elements`` elements each (at least one row); off
    the CPU one slice of all rows. For work that writes each slice's result into its place in an output."""
    rows = x.shape[0]
    step = max(1, elements // max(1, x[0].numel())) if rows else 1
    if x.device.type != "cpu":
        step = max(1, rows)
    return [slice(start, min(rows, start + step)) for start in range(0, rows, step)] or [slice(0, 0)]


def _rows(value: Tensor | None, start: int, end: int, rows: int) -> Tensor | None:
    if value is None or value.ndim == 0 or value.shape[0] != rows:
        return value
    return value[start:end]
