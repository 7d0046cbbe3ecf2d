"""A model's submodules by qualified name, walked without recursion, and walked once where the model is fixed.

Why: ``nn.Module.named_modules`` is a recursive generator, so every module passes up through one generator
frame per level of nesting: on a 256-expert model (~60,000 modules, six levels deep) one walk took ~0.2 s.
:func:`walk_modules` visits the same modules in the same order in half that, and inside
:func:`walks_cached` (the plan, which walks a meta model it never changes about ten times) only once.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

NamedModules = tuple[tuple[str, torch.nn.Module], ...]

_cached: contextvars.ContextVar[dict[int, NamedModules] | None] = contextvars.ContextVar("walks", default=None)


def walk_modules(root: torch.nn.Module) -> NamedModules:
    """``(name, module)`` for ``root`` (named ``""``) and each submodule, as ``root.named_modules()`` lists them:
    parents first, children in registration order, a module reached twice listed once (its first name)."""
    cache = _cached.get()
    if cache is not None and id(root) in cache:
        return cache[id(root)]
    found: list[tuple[str, torch.nn.Module]] = []
    seen: set[int] = set()
    stack: list[tuple[str, torch.nn.Module]] = [("", root)]
    while stack:
        name, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        found.append((name, module))
        prefix = name + "." if name else ""
        stack.extend(reversed([(prefix + key, child) for key, child in module._modules.items() if child is not None]))
    return tuple(found)


@contextlib.contextmanager
def walks_cached(root: torch.nn.Module) -> Iterator[None]:
    """Within the block, every :func:`walk_modules` of ``root`` returns one walk made on entry: only for code
    that adds, removes and replaces no submodule of ``root`` meanwhile."""
    cache = dict(_cached.get() or {})
    cache[id(root)] = walk_modules(root)
    token = _cached.set(cache)
    try:
        yield
    finally:
        _cached.reset(token)


def all_parameters(root: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Every parameter of ``root`` once (a tied one at its first place), as ``root.parameters()`` gives them."""
    found: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for _, module in walk_modules(root):
        for parameter in module._parameters.values():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                found.append(parameter)
    return found
