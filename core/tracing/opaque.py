"""What the tracer calls as one opaque node instead of tracing through.

Rules are generic, by where code lives, so they survive the next transformers release:
every public function defined in ``transformers.masking_utils`` (mask builders branch on
tensor values) or in ``transformers.integrations.*`` (kernels, attention back-ends) is opaque,
whether a forward names it or looks it up in a registry (:func:`registry_mappings`).
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from torch import fx
from torch.utils import _pytree as pytree

#: module-name prefixes whose functions are always called opaquely
OPAQUE_MODULE_PREFIXES: tuple[str, ...] = ("transformers.masking_utils", "transformers.integrations")


def _functions_of(module: types.ModuleType) -> Iterable[Callable[..., Any]]:
    name = module.__name__
    for attr, value in vars(module).items():
        if not attr.startswith("_") and isinstance(value, types.FunctionType) and value.__module__ == name:
            yield value


def default_opaque_functions(prefixes: Sequence[str] = OPAQUE_MODULE_PREFIXES) -> list[Callable[..., Any]]:
    """Public functions defined in already-imported modules under ``prefixes``."""
    try:  # make sure the mask builders are imported even if no model imported them yet
        import transformers.masking_utils  # noqa: F401
    except Exception:  # noqa: BLE001, S110 # pragma: no cover - transformers missing or broken
        pass
    found = []
    for mod_name, module in list(sys.modules.items()):
        if module is not None and any(mod_name == p or mod_name.startswith(p + ".") for p in prefixes):
            found.extend(_functions_of(module))
    return found


class LazyFunctions(Sequence):
    """Opaque functions found by ``find()`` on first use, for :attr:`ModelPatch.opaque_functions`.

    Why: finding them imports a transformers modeling module (~1.5 s and ~150 MiB); a patch that did so
    when registered made every command pay for it (``layerwise plugins``, ``plan``, model-free runs),
    though only tracing that architecture reads them.
    """

    def __init__(self, find: Callable[[], Iterable[Callable[..., Any]]]) -> None:
        self._find = find
        self._found: tuple[Callable[..., Any], ...] | None = None

    def _functions(self) -> tuple[Callable[..., Any], ...]:
        if self._found is None:
            self._found = tuple(self._find())
        return self._found

    def __getitem__(self, index):  # type: ignore[override]
        return self._functions()[index]

    def __len__(self) -> int:
        return len(self._functions())

    def __repr__(self) -> str:
        return f"LazyFunctions({getattr(self._find, '__qualname__', self._find)!r})"


def registry_mappings() -> list[dict[str, Any]]:
    """The dicts behind transformers' function registries (``ALL_ATTENTION_FUNCTIONS`` & co.).

    Each ``GeneralInterface`` subclass keeps a class-wide mapping; the global attention
    registry may also hold local overrides.
    """
    try:
        from transformers.utils.generic import GeneralInterface
    except ImportError:  # pragma: no cover - transformers missing or reorganised
        return []
    found: list[dict[str, Any]] = []
    classes: list[type] = [GeneralInterface]
    while classes:
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        mapping = cls.__dict__.get("_global_mapping")
        if isinstance(mapping, dict) and all(mapping is not m for m in found):
            found.append(mapping)
    attention = getattr(sys.modules.get("transformers.modeling_utils"), "ALL_ATTENTION_FUNCTIONS", None)
    local = getattr(attention, "_local_mapping", None)
    if isinstance(local, dict):
        found.append(local)
    return found


def find_proxy(*values: Any) -> fx.Proxy | None:
    """The first proxy among (nested) ``values``, if any."""
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, fx.Proxy):
            return leaf
    return None


def opaque(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` recorded as one ``call_function`` node when it receives traced values.

    A decorator for model patches: helpers whose shapes depend on tensor values (dropping
    padding images, splitting per sample) run at replay instead of being traced. Without
    traced arguments (the plain forward) ``fn`` simply runs.
    """

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        proxy = find_proxy(args, kwargs)
        if proxy is None:
            return fn(*args, **kwargs)
        call_opaque = getattr(proxy.tracer, "call_opaque", None)
        if call_opaque is not None:  # the layerwise tracer: dict/tuple results keep their structure
            return call_opaque(fn, args, kwargs, listed=not hasattr(fn, "__layerwise_stmt__"))
        return proxy.tracer.create_proxy("call_function", fn, args, kwargs)

    call.__layerwise_opaque__ = fn  # type: ignore[attr-defined]
    return call
