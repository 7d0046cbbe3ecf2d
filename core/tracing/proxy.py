"""Proxies that carry a meta value, so shape questions get concrete answers while tracing."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from .guards import read_value
from .meta import UNKNOWN


class UntraceableError(TypeError):
    """A traced value was used in a way the graph cannot express (e.g. ``if tensor.any():``).

    A ``TypeError`` on purpose: code that probes values with ``try: iter(x) except TypeError``
    keeps working.
    """


#: tensor attributes that never change between calibration batches: answered concretely
_CONCRETE_ATTRS = frozenset({"dtype", "ndim", "is_cuda", "is_sparse", "is_quantized", "layout", "requires_grad",
                             "is_floating_point", "is_complex"})
#: tensor methods answered concretely for the same reason
CONCRETE_METHODS = frozenset({"dim", "ndimension", "is_floating_point", "is_complex", "element_size",
                              "is_contiguous", "get_device"})


class MetaProxy(fx.Proxy):
    """An ``fx.Proxy`` with ``meta``: the value this node computes, on the meta device.

    ``bool``, ``len``, ``int`` and iteration are answered from ``meta``; values that depend
    on tensor *contents* raise :class:`UntraceableError`. ``isinstance(p, torch.Tensor)``
    stays False on purpose: faking ``__class__`` makes torch's C argument parser treat the
    proxy as a real tensor and crash.
    """

    meta: Any = UNKNOWN
    #: derived from an opaque call, whose result may differ in kind at run time (a mask
    #: builder returns None or a tensor depending on the data): never answered concretely
    uncertain: bool = False

    def _known(self, what: str) -> Any:
        if self.uncertain:
            raise UntraceableError(f"{what} of traced value {self.node.name!r}, which comes from an opaque call "
                                   "whose result can differ at run time")
        if self.meta is UNKNOWN:
            raise UntraceableError(f"{what} of traced value {self.node.name!r}, whose shape could not be inferred")
        return self.meta

    def _concrete(self, what: str) -> Any:
        value = self._known(what)
        if isinstance(value, torch.Tensor):
            raise UntraceableError(
                f"{what} of traced tensor {self.node.name!r} depends on tensor values (data-dependent control flow)")
        return value

    def _read(self, how: str, what: str) -> Any:
        """A concrete answer the graph will be specialised on: recorded as a guard."""
        return self._recorded(how, read_value(how, self._concrete(what)))

    def _recorded(self, how: str, value: Any) -> Any:
        """``value``, after telling the tracer (if it keeps guards) that Python read it ``how``."""
        record = getattr(self.tracer, "record_read", None)
        if record is not None:
            record(self, how, value)
        return value

    def __bool__(self) -> bool:
        return self._read("bool", "truth value")

    def __index__(self) -> int:
        return self._read("int", "integer value")

    def __int__(self) -> int:
        return self._read("int", "integer value")

    def __float__(self) -> float:
        return self._read("float", "float value")

    def __len__(self) -> int:
        value = self._known("len()")
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            raise TypeError("len() of a 0-d tensor")
        return self._recorded("len", len(value))

    def __iter__(self):  # type: ignore[override]
        value = self.meta
        if value is UNKNOWN:
            raise UntraceableError(f"iteration over traced value {self.node.name!r} of unknown length")
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            raise TypeError("iteration over a 0-d tensor")
        return iter([self[i] for i in range(self._recorded("len", len(value)))])

    def __contains__(self, item: Any) -> bool:
        return item in self._concrete("membership test")

    def keys(self):  # ``**proxy`` on a traced dict
        return self._known("keys()").keys()

    def __getattr__(self, name: str) -> Any:
        if name in _CONCRETE_ATTRS and isinstance(self.meta, torch.Tensor) and not self.uncertain:
            return getattr(self.meta, name)
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return MetaAttribute(self, name)


class MetaAttribute(MetaProxy, fx.proxy.Attribute):
    """Lazy attribute of a proxy (``x.shape``, ``x.view``) that also knows its meta value."""

    def __init__(self, root: MetaProxy, attr: str) -> None:
        fx.proxy.Attribute.__init__(self, root, attr)
        self.uncertain = root.uncertain
        meta = root.meta
        try:
            self.meta = UNKNOWN if meta is UNKNOWN else getattr(meta, attr)
        except Exception:  # noqa: BLE001 - an attribute the meta value lacks: unknown, not an error
            self.meta = UNKNOWN

    @property
    def node(self):  # type: ignore[override]
        if self._node is None:
            proxy = self.tracer.create_proxy("call_function", getattr, (self.root, self.attr), {})
            self._node = proxy.node
        return self._node

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.tracer.create_proxy("call_method", self.attr, (self.root, *args), kwargs)
