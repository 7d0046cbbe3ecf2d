"""Several cached calls of a block as one call on their inputs stacked along the batch dimension.

A tuning step that runs its samples one call each pays, per Linear, one weight-gradient matmul and
one weight-sized gradient sum per sample; stacked, one matmul gives the summed gradient (on a small
encoder block that is an eighth of the step). Calls stack when they have the same structure:

* a tensor whose first dimension is the call's row count (its output's first dimension) and whose
  other dimensions, dtype and device match across the calls is concatenated;
* any other value (a tensor without the batch dimension, a number, ``None``, an object) must be the
  same in every call (equal tensors, equal plain values, the very same object) and is passed once.

That rule reads a shared tensor of first dimension 1 (with single-row calls) as batched too, so
whether stacking keeps the block's outputs is for the caller to check once on real calls
(:func:`same_outputs`) before relying on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

#: values compared with ``==`` when deciding that calls share them (anything else must be the same object)
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


class _Unstackable(Exception):
    """Two calls differ in something that is neither batched nor shared."""


def signature(args: tuple[Any, ...], kwargs: dict[str, Any], rows: int) -> tuple[Any, ...]:
    """What must agree for calls to stack: the structure, and each tensor's shape, dtype and device
    (the batch dimension as ``rows``-relative, so calls of different row counts can still stack)."""
    return _signature((args, kwargs), rows)


def _signature(value: Any, rows: int) -> Any:
    if isinstance(value, Tensor):
        batched = value.ndim >= 1 and value.shape[0] == rows
        return ("tensor", batched, tuple(value.shape[1:]) if batched else tuple(value.shape), value.dtype,
                value.device)
    if type(value) in (tuple, list):
        return (type(value), tuple(_signature(v, rows) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _signature(v, rows)) for k, v in value.items()))
    return (type(value),)


def stack_calls(calls: Sequence[tuple[tuple[Any, ...], dict[str, Any], int]]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """One call's ``(args, kwargs)`` for ``calls`` (each ``(args, kwargs, rows)``, of one :func:`signature`),
    or ``None`` where they cannot stack (a value differs that is neither batched nor shared)."""
    rows = [call[2] for call in calls]
    try:
        args, kwargs = _stack([(call[0], call[1]) for call in calls], rows)
    except _Unstackable:
        return None
    return args, kwargs


def _stack(values: list[Any], rows: list[int]) -> Any:
    first = values[0]
    if isinstance(first, Tensor):
        if all(isinstance(v, Tensor) and v.ndim >= 1 and v.shape[0] == n and v.shape[1:] == first.shape[1:]
               and v.dtype == first.dtype and v.device == first.device for v, n in zip(values, rows)):
            return torch.cat(values)
        if all(v is first or (isinstance(v, Tensor) and v.shape == first.shape and v.dtype == first.dtype
                              and v.device == first.device and torch.equal(v, first)) for v in values):
            return first
        raise _Unstackable
    if type(first) in (tuple, list):
        if any(type(v) is not type(first) or len(v) != len(first) for v in values):
            raise _Unstackable
        return type(first)(_stack([v[i] for v in values], rows) for i in range(len(first)))
    if isinstance(first, dict):
        if any(not isinstance(v, dict) or v.keys() != first.keys() for v in values):
            raise _Unstackable
        return {key: _stack([v[key] for v in values], rows) for key in first}
    if all(v is first or (isinstance(first, _PLAIN) and type(v) is type(first) and v == first) for v in values):
        return first
    raise _Unstackable


def same_outputs(stacked: Tensor, separate: Sequence[Tensor]) -> bool:
    """Whether a stacked call's output is the separate calls' outputs (concatenated), to within the
    rounding of a different matmul split: at most ``max(1e-3, 4 eps)`` of the largest value apart."""
    expected = torch.cat([t.to(stacked.dtype) for t in separate])
    if expected.numel() == 0:
        return stacked.shape == expected.shape
    if stacked.shape != expected.shape or not stacked.is_floating_point():
        return stacked.shape == expected.shape and torch.equal(stacked, expected)
    tolerance = max(1e-3, 4 * torch.finfo(stacked.dtype).eps) * float(expected.abs().max())
    return float((stacked - expected).abs().max()) <= tolerance
