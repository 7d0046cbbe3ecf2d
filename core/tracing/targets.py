"""Resolving sequential targets and ignore entries to qualified module names.

Entries are module class names (``LlamaDecoderLayer``), exact qualified names, or
``re:<regex>`` matched in full against qualified names (the syntax of
:mod:`layerwise.matching`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import LayerwiseError
from ..matching import matches


class TargetError(LayerwiseError, ValueError):
    """Sequential targets that are missing, match nothing, or cannot be resolved."""


def default_targets(model: torch.nn.Module) -> list[str]:
    """The model's ``_no_split_modules`` (class names), the fallback when no patch gives targets."""
    names = getattr(model, "_no_split_modules", None) or []
    if isinstance(names, str):
        names = [names]
    names = list(dict.fromkeys(names))
    if not names:
        raise TargetError(
            f"{type(model).__name__} declares no _no_split_modules, so there are no default sequential targets; "
            "pass sequential_targets=[...] (class names or 're:<regex>' on module names)")
    return names


def resolve_modules(model: torch.nn.Module, patterns: Sequence[str], *, outermost: bool = True) -> dict[str, torch.nn.Module]:
    """Qualified name -> module for every module matching ``patterns``, in definition order.

    With ``outermost`` a match nested inside another match is dropped (a block's own
    sub-blocks are calibrated with it).
    """
    found: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if not name or not matches(name, module, patterns):
            continue
        if outermost and any(name.startswith(parent + ".") for parent in found):
            continue
        found[name] = module
    return found


def resolve_targets(model: torch.nn.Module, targets: Sequence[str] | None) -> dict[str, torch.nn.Module]:
    """Sequential target modules by qualified name; an error when the entries match nothing."""
    patterns = list(targets) if targets is not None else default_targets(model)
    found = resolve_modules(model, patterns)
    if not found:
        classes = sorted({type(m).__name__ for _, m in model.named_modules()})
        raise TargetError(
            f"sequential targets {patterns} match no module of {type(model).__name__}; "
            f"use class names (some here: {', '.join(classes[:12])}) or 're:<regex on module names>'")
    return found
