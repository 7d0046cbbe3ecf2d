"""Kinds of values, as far as Python control flow can tell them apart, and patterns over them.

A kind is what a ``result`` guard compares: ``None``, ``Tensor``, or a container of kinds
(``tuple(Tensor, None)``, ``{full_attention: Tensor}``). A pattern is a kind that may also
say ``Tensor|None`` (only code that tests it itself reads it: kernels, modules) or ``any``
(nothing in the graph reads it). Kinds are nested tuples, so guards stay hashable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

TENSOR, NONE, TENSOR_OR_NONE, ANY = "Tensor", "None", "Tensor?", "*"

Kind = Any  # str | tuple[str, tuple[Kind, ...]] | tuple[str, tuple[tuple[str, Kind], ...]]


def kind_of(value: Any) -> Kind:
    """The kind of ``value`` (tensors, ``None`` and containers; anything else by type name)."""
    if value is None:
        return NONE
    if isinstance(value, torch.Tensor):
        return TENSOR
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(kind_of(v) for v in value))
    if isinstance(value, Mapping) and not dataclasses.is_dataclass(value):
        return ("dict", tuple((str(k), kind_of(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, tuple((f.name, kind_of(getattr(value, f.name))) for f in dataclasses.fields(value)))
    return type(value).__name__


def matches(pattern: Kind, value: Any) -> bool:
    """Does ``value`` have the kind ``pattern`` describes?"""
    if pattern == ANY:
        return True
    if pattern == TENSOR_OR_NONE:
        return value is None or isinstance(value, torch.Tensor)
    if isinstance(pattern, str):
        return kind_of(value) == pattern
    name, items = pattern
    if name in ("tuple", "list"):
        return (isinstance(value, (tuple, list)) and type(value).__name__ == name and len(value) == len(items)
                and all(matches(p, v) for p, v in zip(items, value)))
    if name == "dict":
        return (isinstance(value, Mapping) and [str(k) for k in value] == [k for k, _ in items]
                and all(matches(p, value[k]) for (k, p), k2 in zip(items, value) for k in [k2]))
    return (type(value).__name__ == name and dataclasses.is_dataclass(value)
            and all(matches(p, getattr(value, f, None)) for f, p in items))


def describe(kind: Kind) -> str:
    """``tuple(Tensor, None)``, ``{full_attention: Tensor?}``: a kind or pattern for people."""
    if isinstance(kind, str):
        return {TENSOR_OR_NONE: "Tensor|None", ANY: "any"}.get(kind, kind)
    name, items = kind
    if name in ("tuple", "list"):
        return f"{name}({', '.join(describe(k) for k in items)})"
    if name == "dict":
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in items) + "}"
    return f"{name}({', '.join(f'{f}={describe(v)}' for f, v in items)})"
