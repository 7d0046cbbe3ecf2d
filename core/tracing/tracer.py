"""The fx tracer: proxies with meta values, targets as leaves, opaque helpers, root shim.

One :class:`LayerwiseTracer` is one attempt; :func:`layerwise.tracing.trace` retries with
more statements wrapped or more modules made leaves until the forward traces. Everything
an attempt decides (leaves, wrapped statements) lives on the tracer or its rewriter, never
in global state.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import fx
from torch.fx import _symbolic_trace as _fx_trace
from torch.utils import _pytree as pytree

from .autowrap import ForwardRewriter
from .meta import UNKNOWN, run_on_meta, to_meta
from .proxy import CONCRETE_METHODS, MetaProxy

_PURE_FUNCTIONS = {getattr, math.sqrt}


class LayerwiseTracer(fx.Tracer):
    """fx tracer that keeps targets/leaves as calls and computes every value on meta."""

    def __init__(
        self,
        model: torch.nn.Module,
        sample_inputs: Mapping[str, Any],
        concrete_args: Mapping[str, Any],
        leaf_names: Iterable[str],
        leaf_classes: Iterable[str] = (),
        opaque_functions: Iterable[Callable[..., Any]] = (),
        rewriter: ForwardRewriter | None = None,
    ) -> None:
        opaque_functions = list(opaque_functions)
        super().__init__(autowrap_modules=(math,), autowrap_functions=tuple(opaque_functions))
        self.proxy_buffer_attributes = True
        self.model = model
        self.sample_inputs = dict(sample_inputs)
        self.concrete_args = dict(concrete_args)
        self.leaf_names = set(leaf_names)
        self.leaf_classes = set(leaf_classes)
        self.rewriter = rewriter or ForwardRewriter()
        self._opaque_ids = {id(f) for f in opaque_functions}
        self.constants: dict[str, Any] = {}
        self.visited: set[str] = set()
        self.module_stack: list[tuple[str, torch.nn.Module]] = []
        self.output_type: type | None = None
        self._meta_depth = 0
        self._module_names = _first_names(model.named_modules(remove_duplicate=False))
        self._tensor_names = _first_names(itertools.chain(model.named_parameters(remove_duplicate=False),
                                                          model.named_buffers(remove_duplicate=False)))
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        self._real_weights = first is not None and not first.is_meta

    # ---- proxies carry meta values -------------------------------------------------
    def proxy(self, node: fx.Node) -> fx.Proxy:
        return MetaProxy(node, self)

    def create_proxy(self, kind, target, args, kwargs, name=None, type_expr=None, proxy_factory_fn=None):  # type: ignore[override]
        if kind == "call_method" and target in CONCRETE_METHODS:
            receiver = getattr(args[0], "meta", UNKNOWN)
            if isinstance(receiver, torch.Tensor) and not getattr(args[0], "uncertain", False):
                return getattr(receiver, target)(*_metas(args[1:]), **_metas(kwargs))
        proxy = super().create_proxy(kind, target, args, kwargs, name, type_expr, proxy_factory_fn)
        proxy.meta = self._infer(kind, target, args, kwargs)
        if kind in ("call_function", "call_method"):
            proxy.uncertain = (id(target) in self._opaque_ids or hasattr(target, "__layerwise_stmt__")
                               or any(getattr(x, "uncertain", False) for x in pytree.tree_leaves((args, kwargs))))
        return proxy

    def _infer(self, kind: str, target: Any, args: tuple, kwargs: dict) -> Any:
        if kind == "placeholder":
            return to_meta(self.sample_inputs.get(target, UNKNOWN))
        if kind == "get_attr":
            self._meta_depth += 1  # plain attribute reads, no proxies
            try:
                return to_meta(self._resolve_attr(target))
            finally:
                self._meta_depth -= 1
        margs, mkwargs = _metas(args), _metas(kwargs)
        if any(leaf is UNKNOWN for leaf in pytree.tree_leaves((margs, mkwargs))):
            return UNKNOWN
        if kind == "call_function":
            fn = target
            real = self._real_weights or not getattr(fn, "__module__", "").startswith(("_operator", "builtins"))
        elif kind == "call_method":
            receiver, margs = margs[0], margs[1:]
            fn, real = getattr(receiver, target, None), False
            if fn is None:
                return UNKNOWN
        elif kind == "call_module":
            fn, real = self.model.get_submodule(target), self._real_weights
        else:
            return UNKNOWN
        self._meta_depth += 1
        try:
            return run_on_meta(fn, margs, mkwargs, real_weights=real)
        finally:
            self._meta_depth -= 1

    def _resolve_attr(self, target: str) -> Any:
        if target in self.constants:
            return self.constants[target]
        obj: Any = self.model
        for part in target.split("."):
            obj = getattr(obj, part)
        return obj

    # ---- arguments that fx cannot express become constants --------------------------
    def create_arg(self, a: Any) -> Any:
        if isinstance(a, fx.Proxy):
            return a.node
        if isinstance(a, torch.Tensor):
            name = self._tensor_names.get(id(a))
            return self.create_node("get_attr", name, (), {}) if name else self._constant(a, "_lw_tensor")
        if isinstance(a, torch.nn.Module):
            name = self._module_names.get(id(a))
            return self.create_node("get_attr", name, (), {}) if name is not None else self._constant(a, "_lw_module")
        if dataclasses.is_dataclass(a) and not isinstance(a, (type, Mapping)):  # configs: pass the object itself
            return self._constant(a, "_lw_const")
        if isinstance(a, tuple) and hasattr(a, "_fields"):  # namedtuple: rebuild with its own class
            return self.create_node("call_function", type(a), tuple(self.create_arg(x) for x in a), {})
        try:
            return fx.proxy.TracerBase.create_arg(self, a)
        except NotImplementedError:
            return self._constant(a, "_lw_const")

    def _constant(self, value: Any, prefix: str) -> fx.Node:
        name = f"{prefix}_{len(self.constants)}"
        self.constants[name] = value
        return self.create_node("get_attr", name, (), {})

    # ---- module boundaries ---------------------------------------------------------
    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        if self._meta_depth or not isinstance(attr_val, torch.Tensor):
            return attr_val
        name = self._tensor_names.get(id(attr_val))
        if name is None:
            return attr_val
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def is_leaf_module(self, m: torch.nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or type(m).__name__ in self.leaf_classes:
            return True
        return (m.__module__.startswith("torch.nn") or m.__module__.startswith("torch.ao.nn")) and not isinstance(
            m, (torch.nn.Sequential, torch.nn.ModuleList, torch.nn.ModuleDict))

    def call_module(self, m: torch.nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self._meta_depth:
            return forward(*args, **kwargs)
        name = self._module_names.get(id(m))
        if name is None:  # a module created on the fly: trace through it
            return forward(*args, **kwargs)
        self.visited.add(name)
        if self.is_leaf_module(m, name):
            return _structured(self.create_proxy("call_module", name, args, kwargs))
        self.module_stack.append((name, m))
        try:
            fn = getattr(m.forward, "__func__", None)
            self._autowrap_globals(fn)
            override = self.rewriter.forward_for(fn) if fn is not None else None
            if override is not None and override is not fn:
                return override(m, *args, **kwargs)
            return forward(*args, **kwargs)
        except Exception as exc:
            if not hasattr(exc, "_lw_culprit"):
                exc._lw_culprit = (name, m)  # type: ignore[attr-defined]
            raise
        finally:
            self.module_stack.pop()

    def _autowrap_globals(self, fn: Callable[..., Any] | None) -> None:
        """Patch opaque functions in the globals of the *undecorated* forward's module.

        fx only looks at the globals of the outermost wrapper, which for decorated HF
        forwards is ``transformers.utils.generic``, not the modeling file.
        """
        patcher = _fx_trace.CURRENT_PATCHER
        inner = inspect.unwrap(fn) if fn is not None else None
        if patcher is not None and inner is not None and hasattr(inner, "__globals__"):
            _fx_trace._autowrap_check(patcher, inner.__globals__, self._autowrap_function_ids)

    # ---- the root call: sample inputs by name, concrete values for the rest ----------
    def create_args_for_root(self, root_fn, is_module, concrete_args=None):  # type: ignore[override]
        placeholders = {name: self.create_proxy("placeholder", name, (), {})
                        for name, value in self.sample_inputs.items() if isinstance(value, torch.Tensor)}
        constants = {name: value for name, value in self.sample_inputs.items() if name not in placeholders}
        fn = self.rewriter.forward_for(root_fn)
        model = self.model

        def root(_model: torch.nn.Module) -> Any:
            self._autowrap_globals(root_fn)
            self.visited.add("")
            self.module_stack.append(("", model))
            try:
                out = fn(model, **placeholders, **constants, **self.concrete_args)
            except Exception as exc:
                if not hasattr(exc, "_lw_culprit"):
                    exc._lw_culprit = ("", model)  # type: ignore[attr-defined]
                raise
            finally:
                self.module_stack.pop()
            return self._flatten_output(out)

        return root, [model]

    def _flatten_output(self, out: Any) -> Any:
        from transformers.utils import ModelOutput

        if isinstance(out, ModelOutput):
            self.output_type = type(out)
            return {k: v for k, v in out.items()}
        return out


def _first_names(pairs: Iterable[tuple[str, Any]]) -> dict[int, str]:
    names: dict[int, str] = {}
    for name, obj in pairs:
        names.setdefault(id(obj), name)
    return names


def _metas(value: Any) -> Any:
    def meta(x: Any) -> Any:
        if isinstance(x, fx.Proxy):
            return getattr(x, "meta", UNKNOWN)
        if isinstance(x, torch.Tensor) and not x.is_meta:
            return torch.empty_like(x, device="meta")
        return x

    return pytree.tree_map(meta, value)


def _structured(proxy: MetaProxy) -> Any:
    """A leaf call returning a tuple/list gives a tuple/list of proxies (``isinstance`` keeps working)."""
    meta = proxy.meta
    if type(meta) in (tuple, list):
        items = [proxy[i] for i in range(len(meta))]
        return type(meta)(items)
    return proxy


def forward_signature(model: torch.nn.Module) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(type(model).forward))
