"""Selecting modules by class name, qualified name, or ``re:`` pattern.

One syntax everywhere (recipes, targets, ignore lists, the CLI):

* ``Linear`` / ``LlamaDecoderLayer`` -- a module class name;
* ``model.layers.0.mlp.down_proj`` -- an exact qualified module name;
* ``re:.*mlp.*`` -- a regular expression matched in full against the qualified name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from layerwise.common.module_walk import walk_modules


def matches(name: str, module: torch.nn.Module, patterns: Iterable[str]) -> bool:
    """Does ``module`` (called ``name`` in its model) match any of ``patterns``?"""
    cls = type(module).__name__
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.fullmatch(pattern[3:], name):
                return True
        elif pattern == cls or pattern == name:
            return True
    return False


def is_linear_like(module: torch.nn.Module) -> bool:
    """A ``torch.nn.Linear``, or transformers' ``Conv1D`` (GPT-2), which stores a transposed Linear."""
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


_is_linear_like = is_linear_like


def find_modules(model: torch.nn.Module, targets: Iterable[str], ignore: Iterable[str] = ()) -> dict[str, torch.nn.Module]:
    """Every submodule matching ``targets`` and not ``ignore``, by qualified name.

    ``Linear`` as a target also selects transformers' ``Conv1D``.
    """
    targets, ignore = list(targets), list(ignore)
    found = {}
    for name, module in walk_modules(model):
        hit = matches(name, module, targets) or ("Linear" in targets and _is_linear_like(module))
        if hit and not matches(name, module, ignore):
            found[name] = module
    return found


def unmatched(model: torch.nn.Module, patterns: Iterable[str]) -> list[str]:
    """Patterns that select nothing in ``model`` (a likely typo in a recipe)."""
    named = walk_modules(model)
    return [p for p in patterns
            if not any(matches(n, m, [p]) or (p == "Linear" and _is_linear_like(m)) for n, m in named)]


def paired_by_parent(model: torch.nn.Module, first: str, second: str) -> tuple[list[tuple[str, str]] | None,
                                                                              list[str], list[str]]:
    """Each module matching ``second`` with the one matching ``first`` beside it (the same parent module): the
    pairs, or ``None`` when some has no partner or a ``first`` is left over; and what each pattern matched."""
    firsts, seconds = find_modules(model, [first]), find_modules(model, [second])
    by_parent = {name.rpartition(".")[0]: name for name in firsts}
    pairs = [(by_parent.get(name.rpartition(".")[0]), name) for name in seconds]
    complete = bool(pairs) and all(a is not None for a, _ in pairs) and len(pairs) == len(firsts)
    return ([(a, b) for a, b in pairs if a is not None] if complete else None), sorted(firsts), sorted(seconds)
