"""Guards: the assumptions a trace was built on, and checking them before a graph runs.

Why: a traced graph is one path through the forward. Where Python decided something on a
value the trace could not know for every batch, the graph silently assumes the sample's
answer: an opaque mask builder returned a tensor (so ``mask is not None`` was baked in), a
size was 16 (so ``if seq_len > 8`` took one branch). Each such decision is a
:class:`Guard`. Two kinds:

- ``result`` -- what an opaque call returned while tracing (``None``, a tensor, a tuple of
  ...). Checked in the graph itself, right after the call (:class:`GuardedCall`), and --
  when it depends on no sequential target -- on real inputs before a batch runs.
- ``value`` -- a concrete number or truth value read from a traced shape (``int(x.size(1))``,
  ``if x.shape[-1] != 3000``). Checked on the meta device before a batch runs: cheap,
  and cached per input-shape signature.

A violated guard is never ignored: :meth:`TraceResult.replay` raises :class:`GuardViolation`;
the sequential pipeline re-traces for the batch (:mod:`layerwise.tracing.retrace`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from ..errors import LayerwiseError
from .autowrap import short_path
from .kinds import ANY, TENSOR_OR_NONE, describe, kind_of, matches
from .meta import UNKNOWN, run_on_meta, to_meta
from .partition import resolve_attr

#: result patterns that any tensor-or-None keeps: checked where they run, not before each batch
LOOSE = (ANY, TENSOR_OR_NONE)
#: folders and files whose frames are never a guard's source (the tracer's own machinery)
_MACHINERY = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(fx.__file__) + os.sep,
              os.path.abspath(torch.overrides.__file__), os.path.abspath(pytree.__file__))


@dataclass(frozen=True)
class Guard:
    """One trace-time decision the graph depends on."""

    #: ``G1``, ``G2``, ... in the order tracing met them
    id: str
    #: ``result`` (what an opaque call returned) or ``value`` (a number read from a shape)
    kind: str
    #: the graph node whose value was decided on
    node: str
    #: for ``result``: the kind pattern of the value (:mod:`.kinds`); for ``value``: the value read
    expected: Any
    #: how the value was read: ``bool``, ``int``, ``float``, ``len`` (``value``) or the function called
    how: str
    #: the line of model code that took the decision (``transformers/.../modeling_x.py:112``)
    source: str
    #: identity across re-traces: the function and its call count (``result`` guards)
    key: str = ""

    def holds(self, got: Any) -> bool:
        """Does a run-time result (``result``) or read value (``value``) keep this guard?"""
        return matches(self.expected, got) if self.kind == "result" else got == self.expected

    def __str__(self) -> str:
        if self.kind == "result":
            return f"{self.id} {self.how}(...) returned {describe(self.expected)} while tracing  [{self.source}]"
        return f"{self.id} {self.how}({self.node}) was {self.expected!r} while tracing  [{self.source}]"


class GuardViolation(LayerwiseError, RuntimeError):
    """A batch breaks an assumption its traced graph was built on (see the guard in the message)."""

    def __init__(self, guard: Guard, got: Any) -> None:
        self.guard, self.got = guard, got
        shown = describe(kind_of(got)) if guard.kind == "result" else repr(got)
        super().__init__(
            f"trace guard {guard} does not hold for this batch: got {shown}. The graph took a decision on that value "
            "while tracing, so it would compute something else than the model. Fix: the sequential pipeline "
            "re-traces per batch by itself; when calling replay() yourself, trace with this batch as the sample "
            "(one TraceResult per kind of batch), or make the deciding code a leaf/opaque in the ModelPatch")


def decision_source() -> str:
    """``file:line`` of the innermost model-code frame on the stack (not the tracer's own)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not os.path.abspath(frame.filename).startswith(_MACHINERY):
            return f"{short_path(frame.filename)}:{frame.lineno}"
    return "<unknown>"


class GuardedCall:
    """An opaque call that checks, every time it runs, that its result has the traced kind."""

    def __init__(self, fn: Callable[..., Any], guard: Guard) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.guard = fn, guard

    def __call__(self, /, *args: Any, **kwargs: Any) -> Any:
        out = self.fn(*args, **kwargs)
        if not self.guard.holds(out):
            raise GuardViolation(self.guard, out)
        return out


def read_value(how: str, value: Any) -> Any:
    """Apply the concrete read a guard recorded (``int``, ``len``, ...) to a value."""
    if how == "len":
        return len(value)
    return {"bool": bool, "int": int, "float": float}[how](value)


@dataclass
class GuardProgram:
    """The parts of a traced graph that compute the guarded values, runnable on their own.

    Kept apart from the partitioned graph (which drops the size probes a decision read).
    ``on_meta`` computes the shape guards (no weights touched, no compute); ``on_real``
    computes the result guards that depend on no sequential target (costs little more
    than the embeddings). Result guards behind a target are checked by the graph itself.
    """

    guards: list[Guard]
    on_meta: fx.GraphModule | None = None
    on_real: fx.GraphModule | None = None
    #: node name -> meta value tracing assumed for it (opaque results decided by a re-trace)
    assumed_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    _shape_checked: dict[tuple, tuple[Guard, Any] | None] = dataclasses.field(default_factory=dict)
    #: every shape guard reads only the length of a shape (``len(x.shape[:-1])``): batches whose tensors
    #: have the same ranks (and size-1 dimensions, which squeeze could drop) answer them alike
    rank_only: bool = False

    @classmethod
    def extract(cls, graph: fx.Graph, guards: list[Guard], targets: Iterable[str], root: torch.nn.Module,
                constants: Mapping[str, Any], assumed_meta: Mapping[str, Any]) -> GuardProgram:
        """Copy the ancestors of the guarded nodes out of ``graph`` (before dead code is dropped)."""
        by_name = {n.name: n for n in graph.nodes}
        targets = set(targets)
        kept: list[Guard] = []
        meta_guards: dict[str, fx.Node] = {}
        real_guards: dict[str, fx.Node] = {}
        for guard in guards:
            node = by_name.get(guard.node)
            if node is None:
                continue
            ancestors = _ancestors(node)
            if not any(n.op == "placeholder" for n in ancestors):
                continue  # decided on a constant (a buffer's size): holds for every batch
            kept.append(guard)
            if guard.kind == "value":
                meta_guards[guard.id] = node
            elif guard.expected not in LOOSE and not any(n.op == "call_module" and n.target in targets
                                                         for n in ancestors):
                real_guards[guard.id] = node  # a loose pattern is left to the in-line check: no per-batch cost
        rank_only = bool(meta_guards) and all(n.meta.get("lw_rank_only") for n in meta_guards.values())
        return cls(kept, _program(graph, meta_guards, root, constants), _program(graph, real_guards, root, constants),
                   dict(assumed_meta), rank_only=rank_only)

    def first_violation(self, inputs: Mapping[str, Any]) -> tuple[Guard, Any] | None:
        """The first guard ``inputs`` break, with what they gave instead; ``None`` when all hold.

        Shape guards are computed on meta once per input-shape signature (on the real
        batch when meta cannot answer); result guards before any sequential target on the
        real inputs.
        """
        by_id = {g.id: g for g in self.guards}
        if self.on_meta is not None:
            signature = _signature(inputs, ranks_only=self.rank_only)
            if signature not in self._shape_checked:
                values = _run(self.on_meta, inputs, on_meta=True, assumed=self.assumed_meta)
                read = {gid: _read(by_id[gid], value) for gid, value in values.items()}
                if any(got is UNKNOWN for got in read.values()):  # meta could not say: ask the real batch
                    values = _run(self.on_meta, inputs, on_meta=False, assumed={})
                    read = {gid: _read(by_id[gid], value) for gid, value in values.items()}
                self._shape_checked[signature] = next(
                    ((by_id[gid], got) for gid, got in read.items() if not by_id[gid].holds(got)), None)
            if self._shape_checked[signature] is not None:
                return self._shape_checked[signature]
        if self.on_real is not None:
            for gid, value in _run(self.on_real, inputs, on_meta=False, assumed={}).items():
                if not by_id[gid].holds(value):
                    return by_id[gid], value
        return None


def _program(graph: fx.Graph, outputs: Mapping[str, fx.Node], root: torch.nn.Module,
             constants: Mapping[str, Any]) -> fx.GraphModule | None:
    """A graph module of ``outputs``' ancestors returning ``{guard id: value}``."""
    if not outputs:
        return None
    needed: set[fx.Node] = set().union(*(_ancestors(n) for n in outputs.values()))
    program = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node in needed:
            env[node] = program.node_copy(node, lambda n: env[n])
    program.output({gid: env[node] for gid, node in outputs.items()})
    attrs = {n.target: resolve_attr(root, constants, n.target) for n in program.nodes if n.op in ("get_attr", "call_module")}
    return fx.GraphModule(attrs, program, class_name="GuardProgram")


def _read(guard: Guard, value: Any) -> Any:
    if value is UNKNOWN:
        return UNKNOWN
    try:
        return read_value(guard.how, value)
    except Exception:  # noqa: BLE001 - a value meta cannot answer: not checkable here
        return UNKNOWN


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen


def _signature(inputs: Mapping[str, Any], ranks_only: bool = False) -> tuple:
    def shape(v: torch.Tensor) -> tuple:
        return tuple(d == 1 for d in v.shape) if ranks_only else tuple(v.shape)

    return tuple(sorted((k, shape(v), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v))
                        for k, v in inputs.items()))


def _run(module: fx.GraphModule, inputs: Mapping[str, Any], *, on_meta: bool,
         assumed: Mapping[str, Any]) -> dict[str, Any]:
    """Evaluate a guard program; on meta every node runs on meta tensors (no compute)."""
    names = [n.target for n in module.graph.nodes if n.op == "placeholder"]
    with torch.no_grad():
        if not on_meta:
            return dict(module(*(inputs.get(n) for n in names)))
        return dict(_GuardInterpreter(module, assumed).run(*(to_meta(inputs.get(n)) for n in names)))


class _GuardInterpreter(fx.Interpreter):
    """Runs each node on meta tensors; an opaque result a re-trace decided is taken as assumed."""

    def __init__(self, module: fx.GraphModule, assumed: Mapping[str, Any]) -> None:
        super().__init__(module, garbage_collect_values=True)
        self.assumed = assumed

    def run_node(self, n: fx.Node) -> Any:
        if n.op in ("placeholder", "get_attr", "output"):
            return super().run_node(n)
        if n.name in self.assumed:
            return self.assumed[n.name]
        args, kwargs = _mutable(self.fetch_args_kwargs_from_env(n))
        if n.op == "call_module":
            fn = self.fetch_attr(n.target)
        elif n.op == "call_method":
            receiver, args = args[0], args[1:]
            fn = getattr(receiver, n.target, None) if receiver is not UNKNOWN else None
        else:
            fn = getattr(n.target, "fn", n.target)  # a GuardedCall would reject a meta result
        if fn is None or any(v is UNKNOWN for v in pytree.tree_leaves((args, kwargs))):
            return UNKNOWN
        return run_on_meta(fn, to_meta(args), to_meta(kwargs), real_weights=True)


def _mutable(value: Any) -> Any:
    """fx's immutable containers as plain ones (a wrapped statement may fill a dict it is given)."""
    if isinstance(value, dict):
        return {k: _mutable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_mutable(v) for v in value]
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_mutable(v) for v in value)
    return value

