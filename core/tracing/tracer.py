"""The fx tracer: proxies with meta values, targets as leaves, opaque helpers, root shim.

One :class:`LayerwiseTracer` is one attempt; :func:`layerwise.tracing.trace` retries with
more statements wrapped or more modules made leaves until the forward traces. Everything
an attempt decides (leaves, wrapped statements) lives on the tracer or its rewriter, never
in global state.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import fx
from torch.fx import _symbolic_trace as _fx_trace
from torch.utils import _pytree as pytree

from .autowrap import ForwardRewriter
from .guards import Guard, decision_source
from .kinds import kind_of
from .meta import UNKNOWN, run_on_meta_stubbed, to_meta
from .opaque import find_proxy, registry_mappings
from .partition import resolve_attr
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
        assumed: Mapping[str, Any] | None = None,
    ) -> None:
        opaque_functions = list(opaque_functions)
        # opaque functions are patched by this tracer itself (``_autowrap_globals``), not by fx,
        # so that their results keep the structure of their meta value (a dict stays a dict)
        super().__init__(autowrap_modules=(math,))
        self.proxy_buffer_attributes = True
        self.model = model
        self.sample_inputs = dict(sample_inputs)
        self.concrete_args = dict(concrete_args)
        self.leaf_names = set(leaf_names)
        self.leaf_classes = set(leaf_classes)
        self.rewriter = rewriter or ForwardRewriter()
        self._opaque_ids = {id(f) for f in opaque_functions}
        self._patched_globals: set[int] = set()
        #: what this attempt decided beyond plain tracing (deduplicated, in order)
        self.notes: dict[str, None] = {}
        self.constants: dict[str, Any] = {}
        self.visited: set[str] = set()
        self.module_stack: list[tuple[str, torch.nn.Module]] = []
        self.output_type: type | None = None
        #: decisions taken on values the trace cannot know for every batch (see guards.py)
        self.guards: list[Guard] = []
        #: guard key (``fn#n``) -> meta value to assume for that opaque result (a re-trace's knowledge)
        self.assumed = dict(assumed or {})
        #: node name -> the assumed meta value actually used
        self.assumed_meta: dict[str, Any] = {}
        self._calls: dict[str, int] = {}
        self._guarded_reads: set[tuple[str, str]] = set()
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
        proxy.meta, stubbed = self._infer(kind, target, args, kwargs)
        if kind in ("call_function", "call_method"):
            # an opaque result may differ in kind at run time; a stubbed meta value (``.item()`` read
            # as 0) says nothing about real data: Python must not decide on either
            proxy.uncertain = (id(target) in self._opaque_ids or hasattr(target, "__layerwise_stmt__")
                               or stubbed
                               or any(getattr(x, "uncertain", False) for x in pytree.tree_leaves((args, kwargs))))
        return proxy

    def record_read(self, proxy: fx.Proxy, how: str, value: Any) -> None:
        """A concrete ``how`` (bool/int/float/len) read of a traced value: a ``value`` guard."""
        if self._meta_depth or isinstance(value, torch.Tensor):
            return
        node = proxy.node
        if (node.name, how) in self._guarded_reads:
            return
        self._guarded_reads.add((node.name, how))
        if how == "len" and isinstance(getattr(proxy, "meta", None), torch.Size):
            node.meta["lw_rank_only"] = True  # the length of a shape: the same for every batch of equal ranks
        self.guards.append(Guard(id=f"G{len(self.guards) + 1}", kind="value", node=node.name, expected=value,
                                 how=how, source=decision_source()))

    def _infer(self, kind: str, target: Any, args: tuple, kwargs: dict) -> tuple[Any, bool]:
        """The node's value on meta, and whether a value-dependent op got a stand-in answer in it."""
        if kind == "placeholder":
            return to_meta(self.sample_inputs.get(target, UNKNOWN)), False
        if kind == "get_attr":
            self._meta_depth += 1  # plain attribute reads, no proxies
            try:
                return to_meta(resolve_attr(self.model, self.constants, target)), False
            finally:
                self._meta_depth -= 1
        margs, mkwargs = _metas(args), _metas(kwargs)
        if any(leaf is UNKNOWN for leaf in pytree.tree_leaves((margs, mkwargs))):
            return UNKNOWN, False
        if kind == "call_function":
            fn = target
            real = self._real_weights or not getattr(fn, "__module__", "").startswith(("_operator", "builtins"))
        elif kind == "call_method":
            receiver, margs = margs[0], margs[1:]
            fn, real = getattr(receiver, target, None), False
            if fn is None:
                return UNKNOWN, False
        elif kind == "call_module":
            fn, real = self.model.get_submodule(target), self._real_weights
        else:
            return UNKNOWN, False
        self._meta_depth += 1
        try:
            with _capture_suspended():  # hooks must not record the meta values
                value, stubbed = run_on_meta_stubbed(fn, margs, mkwargs, real_weights=real)
        finally:
            self._meta_depth -= 1
        return value, stubbed and kind != "call_module"  # a leaf's output shape does not hang on its data

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
            out = structured(self.create_proxy("call_module", name, args, kwargs))
            return self._run_capture_hooks(m, args, kwargs, out)
        self.module_stack.append((name, m))
        try:
            fn = getattr(m.forward, "__func__", None)
            self._autowrap_globals(fn)
            override = self.rewriter.forward_for(fn) if fn is not None else None
            if override is not None and override is not fn:
                out = override(m, *args, **kwargs)
            else:
                out = forward(*args, **kwargs)
            return self._run_capture_hooks(m, args, kwargs, out)
        except Exception as exc:
            if not hasattr(exc, "_lw_culprit"):
                exc._lw_culprit = (name, m)  # type: ignore[attr-defined]
            raise
        finally:
            self.module_stack.pop()

    def _run_capture_hooks(self, m: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        """Call transformers' output-capturing forward hooks with the traced output.

        fx calls a module's forward without its hooks. Most hooks are better off that way (they
        run again at replay, where the graph calls the module), but transformers records
        ``hidden_states``/``attentions`` through forward hooks into a collector that the
        decorated model forward reads back: that data flow must go through the graph, so those
        hooks see the proxies here (and at replay find no active collector: a no-op).
        """
        for hook_id, hook in list(m._forward_hooks.items()):
            if not is_output_capturing_hook(hook):
                continue
            if _capture_active():
                self.notes[f"transformers' output-capturing hooks on {type(m).__name__} were called with the traced "
                           "outputs (they feed hidden_states/attentions back into the forward)"] = None
            if hook_id in m._forward_hooks_with_kwargs:
                result = hook(m, args, kwargs, out)
            else:
                result = hook(m, args, out)
            if result is not None:
                out = result
        return out

    def _autowrap_globals(self, fn: Callable[..., Any] | None) -> None:
        """Patch opaque functions in the globals of the forward and of the *undecorated* forward.

        fx only looks at the globals of the outermost wrapper, which for decorated HF
        forwards is ``transformers.utils.generic``, not the modeling file.
        """
        patcher = _fx_trace.CURRENT_PATCHER
        if patcher is None or fn is None:
            return
        for f in (fn, inspect.unwrap(fn)):
            frame = getattr(f, "__globals__", None)
            if frame is None or id(frame) in self._patched_globals:
                continue
            self._patched_globals.add(id(frame))
            self._patch_opaque_entries(patcher, frame)

    def _autowrap_registries(self) -> None:
        """Patch opaque functions that forwards look up in a registry, not by global name.

        transformers fetches the attention back-end with ``ALL_ATTENTION_FUNCTIONS.get_interface``.
        Traced inline, sdpa's ``attention_mask is None`` test would be decided at trace time (a
        traced mask is never ``None``) while the mask builder returns ``None`` at run time for
        unpadded inputs: the replay would attend to future tokens. Called opaquely, the test
        runs at replay on the real mask.
        """
        patcher = _fx_trace.CURRENT_PATCHER
        if patcher is None:
            return
        for mapping in registry_mappings():
            self._patch_opaque_entries(patcher, mapping)

    def _patch_opaque_entries(self, patcher: Any, mapping: dict[str, Any]) -> None:
        """Replace, until tracing ends, each public entry of ``mapping`` that is an opaque function."""
        for name, value in list(mapping.items()):
            if not name.startswith("_") and id(value) in self._opaque_ids:
                patcher.patch(mapping, name, self._opaque_call(value))

    def _opaque_call(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            proxy = find_proxy(args, kwargs)
            if proxy is None:
                return fn(*args, **kwargs)
            return self.call_opaque(fn, args, kwargs, listed=True)

        return call

    def call_opaque(self, fn: Callable[..., Any], args: tuple, kwargs: dict, listed: bool = False) -> Any:
        """``fn`` as one graph node; a dict/tuple/ModelOutput result comes back as a container of proxies.

        The container's structure (keys, length) is read from the meta result, so code such as
        ``isinstance(mask, dict)`` or ``a, b = helper(x)`` sees what it would at run time.
        ``listed`` marks the node as an opaque helper call (``TraceResult.opaque_calls``).
        """
        proxy = self.create_proxy("call_function", fn, args, kwargs)
        if listed:
            proxy.node.meta["is_wrapped"] = True
        name = f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"
        self._calls[name] = self._calls.get(name, 0) + 1
        key = f"{name}#{self._calls[name]}"
        if key in self.assumed:  # a re-trace: what this call returned for the batch that broke a guard
            proxy.meta = self.assumed[key]
            self.assumed_meta[proxy.node.name] = proxy.meta
        if proxy.meta is not UNKNOWN:
            self.guards.append(Guard(id=f"G{len(self.guards) + 1}", kind="result", node=proxy.node.name,
                                     expected=kind_of(proxy.meta), how=getattr(fn, "__name__", str(fn)),
                                     source=decision_source(), key=key))
            proxy.node.meta["lw_guard"] = self.guards[-1]
            proxy.node.meta["lw_meta"] = proxy.meta
        out = structured(proxy, none_is_none=proxy.meta is not UNKNOWN)
        if listed and out is not proxy:
            self.notes[f"opaque {getattr(fn, '__name__', fn)} returns a {type(proxy.meta).__name__}: kept as that "
                       "container of per-item nodes (structure from its meta result)"] = None
        return out

    # ---- the root call: sample inputs by name, concrete values for the rest ----------
    def create_args_for_root(self, root_fn, is_module, concrete_args=None):  # type: ignore[override]
        placeholders = {name: self.create_proxy("placeholder", name, (), {})
                        for name, value in self.sample_inputs.items() if isinstance(value, torch.Tensor)}
        constants = {name: value for name, value in self.sample_inputs.items() if name not in placeholders}
        fn = self.rewriter.forward_for(root_fn)
        model = self.model

        def root(_model: torch.nn.Module) -> Any:
            self._autowrap_globals(root_fn)
            self._autowrap_registries()
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


def structured(proxy: MetaProxy, none_is_none: bool = False) -> Any:
    """A call whose meta value is a tuple/list/dict/ModelOutput as that container of proxies.

    ``isinstance`` checks and unpacking keep working; unused items are dropped later as dead
    code. Anything else (a tensor, an unknown value) stays one proxy. With ``none_is_none``
    (a guarded opaque result) a ``None`` is Python's ``None``, so the code takes its
    ``is None`` path as it did for the sample; otherwise it stays a proxy.
    """
    meta = proxy.meta
    if meta is None and none_is_none:
        return None
    if type(meta) in (tuple, list):
        return type(meta)(structured(proxy[i], none_is_none) for i in range(len(meta)))
    if type(meta) is dict:
        return {k: structured(proxy[k], none_is_none) for k in meta}
    if _is_model_output(meta):
        return _model_output(type(meta), {f.name: structured(getattr(proxy, f.name), none_is_none)
                                          if getattr(meta, f.name) is not None else None
                                          for f in dataclasses.fields(meta)})
    return proxy


def _is_model_output(value: Any) -> bool:
    try:
        from transformers.utils import ModelOutput
    except ImportError:  # pragma: no cover - transformers missing
        return False
    return isinstance(value, ModelOutput) and dataclasses.is_dataclass(value)


def _model_output(cls: type, values: dict[str, Any]) -> Any:
    """``cls(**values)`` without ``__post_init__`` (it probes the first field's iterability)."""
    out = cls.__new__(cls)
    OrderedDict.__init__(out)
    for name, value in values.items():
        object.__setattr__(out, name, value)
        if value is not None:
            OrderedDict.__setitem__(out, name, value)
    return out


def _collector() -> Any:
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # pragma: no cover - other transformers versions
        return None
    return _active_collector


def _capture_active() -> bool:
    collector = _collector()
    return collector is not None and bool(collector.get())


@contextlib.contextmanager
def _capture_suspended() -> Iterator[None]:
    """No active transformers output collector inside the block (its hooks become no-ops).

    Shape inference runs leaf modules on meta tensors; their output-capturing hooks would
    otherwise append those meta tensors to the collector of the forward being traced.
    """
    collector = _collector()
    if collector is None or collector.get() is None:
        yield
        return
    token = collector.set(None)
    try:
        yield
    finally:
        collector.reset(token)


def is_output_capturing_hook(hook: Any) -> bool:
    """Is ``hook`` one of transformers' output-capturing forward hooks (``capture_outputs``)?"""
    module = getattr(hook, "__module__", "") or ""
    return module.startswith("transformers.utils") and "output_capturing_hook" in getattr(hook, "__qualname__", "")


def forward_signature(model: torch.nn.Module) -> inspect.Signature:
    return inspect.signature(inspect.unwrap(type(model).forward))
