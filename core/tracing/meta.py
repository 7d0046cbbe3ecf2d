"""Shape metadata for proxies: every traced value is also computed on the meta device.

Why: Python control flow in a forward (``if x.shape[1] > 1``, ``len(...)``, ``.dim()``)
needs concrete answers while tracing, but tracing must not touch real weights. Running
each recorded operation on meta tensors gives those answers for free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

#: marker for "this value's metadata is unknown" (its op could not run on meta)
UNKNOWN = object()


def to_meta(value: Any) -> Any:
    """Meta-device twin of a (nested) value; non-tensors are returned as they are."""

    def convert(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and not x.is_meta:
            return torch.empty_like(x, device="meta")
        return x

    return pytree.tree_map(convert, value)


class _DataDependentDefaults(TorchDispatchMode):
    """Answers value-dependent ops on meta tensors with neutral stand-ins.

    ``.item()`` gives 0/False and ``nonzero`` gives no rows, so MoE routing loops run zero
    times and value checks pass: only the *shape* of a module's output matters here. Boolean
    mask indexing (``x[keep]``) keeps every row: the common case (no padding dropped).
    """

    def __init__(self) -> None:
        super().__init__()
        #: did any op get a stand-in answer (so the result is not what real data would give)?
        self.stubbed = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        aten = torch.ops.aten
        first = args[0] if args else None
        if isinstance(first, torch.Tensor) and first.is_meta:
            stub = _STUBS.get(func)
            if stub is not None:
                self.stubbed = True
                return stub(first)
            if func in (aten.index.Tensor, aten._unsafe_index.Tensor):
                self.stubbed = self.stubbed or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                                   for i in (args[1] if len(args) > 1 else ()))
                with _assume_all_nonzero():
                    return func(*args, **kwargs)
        return func(*args, **kwargs)


_STUBS = {
    torch.ops.aten._local_scalar_dense.default:
        lambda t: False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0),
    torch.ops.aten.is_nonzero.default: lambda t: False,
    torch.ops.aten.nonzero.default: lambda t: torch.empty((0, t.dim()), dtype=torch.long, device="meta"),
    torch.ops.aten.equal.default: lambda t: True,
}


def _assume_all_nonzero() -> Any:
    from torch.fx.experimental import _config

    return _config.patch(meta_nonzero_assume_all_nonzero=True)


class _ToMetaMode(torch.overrides.TorchFunctionMode):
    """Moves every tensor argument to meta before each torch call (real weights stay put)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        args, kwargs = to_meta((args, kwargs))
        if kwargs.get("device") is not None and func in _FACTORIES:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


_FACTORIES = {torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.rand, torch.randn,
              torch.zeros_like, torch.ones_like, torch.full_like, torch.empty_like, torch.eye, torch.linspace}


def run_on_meta(fn: Callable[..., Any], args: tuple, kwargs: dict, real_weights: bool) -> Any:
    """``fn(*args, **kwargs)`` on meta inputs; ``UNKNOWN`` when even the fallbacks fail."""
    return run_on_meta_stubbed(fn, args, kwargs, real_weights)[0]


def run_on_meta_stubbed(fn: Callable[..., Any], args: tuple, kwargs: dict, real_weights: bool) -> tuple[Any, bool]:
    """``fn`` on meta inputs, and whether a value-dependent op got a stand-in answer.

    First a plain call (fast path: everything already on meta), then with tensors moved
    to meta on the fly (real weights) and value-dependent ops stubbed. A stubbed result
    is a shape, not a fact: a decision taken on it would hold for no real batch.
    """
    if not real_weights:
        try:
            return fn(*args, **kwargs), False
        except Exception:  # noqa: BLE001, S110 - any failure: retry with weights moved to meta
            pass
    stubs = _DataDependentDefaults()
    try:
        with _ToMetaMode(), stubs:
            return fn(*args, **kwargs), stubs.stubbed
    except Exception:  # noqa: BLE001 - a value the meta device cannot compute stays unknown
        return UNKNOWN, False
