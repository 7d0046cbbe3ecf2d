"""``trace()``: trace a model, retrying with autowrap and robust leaves, then partition it."""

from __future__ import annotations

import dataclasses
import inspect
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import fx

from layerwise.host.model_patch import ModelPatch
from layerwise.host.patch_selection import use_patch
from layerwise.host.versions import warn_if_untested
from layerwise.tracing import kinds

from .autowrap import ForwardRewriter, WrappedStatement
from .guards import Guard, GuardedCall, GuardProgram
from .meta import to_meta
from .opaque import default_opaque_functions
from .partition import CUTS, Subgraph, eliminate_dead_pure_nodes, is_pure, partition, resolve_attr
from .result import OpaqueCall, SwallowedTargetsError, TraceError, TraceResult
from .targets import TargetError, choose_targets, resolve_modules, resolve_targets
from .tracer import LayerwiseTracer, forward_signature

#: how many times a trace is retried after wrapping a statement or making a module a leaf
MAX_ATTEMPTS = 64


def trace(
    model: torch.nn.Module,
    sample_inputs: Mapping[str, Any],
    sequential_targets: Sequence[str] | None = None,
    ignore: Sequence[str] | None = None,
    targets_per_subgraph: int = 1,
    robust: bool = True,
    opaque_functions: Sequence[Callable[..., Any]] = (),
    leaf_modules: Sequence[str] = (),
    skip_uncalled_targets: bool | None = None,
    patch: ModelPatch | str | bool | None = None,
    cut: str = "after",
) -> TraceResult:
    """Trace ``model``'s forward on ``sample_inputs`` and cut it into per-target subgraphs.

    ``sample_inputs`` are keyword arguments of the model's forward (``input_ids``, ...); only
    their shapes and dtypes matter (they are moved to meta). ``patch`` picks the model patch
    as ``compress()`` does (``None``/``True``: the registered one that matches, ``False``:
    none, a name or a :class:`ModelPatch`); it is applied, and its targets, ignore list,
    opaque functions and leaf modules are used. Targets and ignore entries are class names,
    qualified names or ``re:<regex>``; targets default to the patch's, else the model's
    ``_no_split_modules``. Ignored modules and ``leaf_modules`` (class names) are called as
    single nodes. Statements that cannot be traced are wrapped into opaque calls; with
    ``robust`` a module whose forward still fails becomes a leaf (see ``failed_modules``).
    A target the forward never calls with these inputs (a vision tower given text only) is
    left out of ``target_names`` (and noted) when the targets are defaults, an error when the
    caller named them; ``skip_uncalled_targets`` overrides either way.

    ``cut="after"`` ends each subgraph with its targets (blocks: a piece's targets see inputs
    it computed). ``cut="before"`` starts each subgraph after the first with the targets that
    read one same value (q/k/v, gate/up; ``targets_per_subgraph`` must be 1) and ends it with
    what the next ones read, so a pipeline can gather the targets' statistics from cached
    inputs and run every piece once (see :attr:`~layerwise.tracing.partition.Subgraph.entries`);
    each target must then be called exactly once.

    Decisions taken on values that can change from batch to batch are ``guards`` on the
    result; ``replay`` checks them. Where the sample itself breaks one (meta guessed what an
    opaque call returns), the model is traced again with what the sample really gave.

    The first subgraph takes the model inputs by name; the last one returns
    ``{"output": <the model's ModelOutput class rebuilt, or its tuple/tensor>}``.
    """
    warn_if_untested()
    args = dict(sequential_targets=sequential_targets, ignore=ignore, targets_per_subgraph=targets_per_subgraph,
                robust=robust, opaque_functions=opaque_functions, leaf_modules=leaf_modules,
                skip_uncalled_targets=skip_uncalled_targets, patch=patch, cut=cut)
    assumed: dict[str, Any] = {}  # guard key -> meta value the sample's opaque call really returned
    for _ in range(MAX_SAMPLE_RETRACES):
        result = _trace(model, sample_inputs, assumed=assumed, **args)
        broken = _broken_on_sample(result, sample_inputs)
        if broken is None:
            return result
        guard, got = broken
        if guard.kind != "result" or guard.key in assumed:
            return result  # nothing more a re-trace can learn; replay() names the guard
        assumed[guard.key] = to_meta(got)  # what the sample really gives, not what meta guessed
    return result


#: re-traces trace() makes so that its graph holds for its own sample
MAX_SAMPLE_RETRACES = 8


def _broken_on_sample(result: TraceResult, sample_inputs: Mapping[str, Any]) -> Any:
    """The first guard the sample itself breaks (meta guesses an opaque result), if it has real values."""
    tensors = [v for v in sample_inputs.values() if isinstance(v, torch.Tensor)]
    weight = next(result.model.parameters(), None)
    if not tensors or any(t.is_meta for t in tensors) or (weight is not None and weight.is_meta):
        return None
    with torch.no_grad():
        return result.guard_violation(sample_inputs)


def _trace(
    model: torch.nn.Module,
    sample_inputs: Mapping[str, Any],
    sequential_targets: Sequence[str] | None,
    ignore: Sequence[str] | None,
    targets_per_subgraph: int,
    robust: bool,
    opaque_functions: Sequence[Callable[..., Any]],
    leaf_modules: Sequence[str],
    skip_uncalled_targets: bool | None,
    patch: ModelPatch | str | bool | None,
    assumed: Mapping[str, Any],
    cut: str = "after",
) -> TraceResult:
    if targets_per_subgraph < 1:
        raise ValueError(f"targets_per_subgraph must be >= 1, got {targets_per_subgraph}")
    if cut not in CUTS:
        raise ValueError(f"cut must be one of {', '.join(CUTS)}, got {cut!r}")
    if cut == "before" and targets_per_subgraph != 1:
        raise ValueError("cut='before' groups the targets that read one same value; targets_per_subgraph must be 1")
    chosen = use_patch(model, patch)
    if skip_uncalled_targets is None:
        skip_uncalled_targets = sequential_targets is None
    if sequential_targets is None:  # the patch's, else _no_split_modules, else found by structure
        sequential_targets = list(choose_targets(model, None, chosen).targets) or None
    if chosen is not None:
        if ignore is None:
            ignore = list(chosen.ignore)
        opaque_functions = [*chosen.opaque_functions, *opaque_functions]
        leaf_modules = [*chosen.leaf_modules, *leaf_modules]
    ignored = resolve_modules(model, list(ignore)) if ignore else {}
    targets = {n: m for n, m in resolve_targets(model, sequential_targets).items() if n not in ignored}
    if not targets:
        raise TargetError(f"every sequential target of {type(model).__name__} is also ignored")
    notes: list[str] = []
    concrete = _concrete_args(model, sample_inputs, notes)
    opaque_fns = [*default_opaque_functions(), *opaque_functions]
    rewriter = ForwardRewriter()
    failed: dict[str, str] = {}

    for _ in range(MAX_ATTEMPTS):
        tracer = LayerwiseTracer(model, sample_inputs, concrete, [*targets, *ignored, *failed], leaf_modules,
                                 opaque_fns, rewriter, assumed)
        try:
            with torch.no_grad():
                graph = tracer.trace(model)
            break
        except Exception as exc:
            culprit = getattr(exc, "_lw_culprit", None)
            why = f"{type(exc).__name__}: {exc}"
            if culprit is None:
                raise TraceError(f"tracing {type(model).__name__} failed outside any module forward: {why}") from exc
            name, module = culprit
            fixed = _autowrap(rewriter, module, name, exc, why)
            if isinstance(fixed, WrappedStatement):
                continue
            if robust and name and name not in targets:
                failed[name] = f"{why} ({fixed})"
                continue
            where = repr(name) if name else f"the model ({type(model).__name__})"
            hint = ("pass robust=True to make it a leaf" if name and not robust
                    else "give it a traceable override in its ModelPatch, or ignore it")
            raise TraceError(f"cannot trace {where}: {why}; autowrap: {fixed}. Fix: {hint}") from exc
    else:
        raise TraceError(f"tracing {type(model).__name__} did not converge after {MAX_ATTEMPTS} attempts; "
                         f"wrapped so far: {[str(r) for r in rewriter.records]}, failed: {failed}")

    if tracer.output_type is not None:
        _rebuild_output(graph, tracer.output_type)
    guards = GuardProgram.extract(graph, _loosen(graph, tracer.guards), targets, model, tracer.constants,
                                  tracer.assumed_meta)
    _check_results_inline(graph)
    eliminate_dead_pure_nodes(graph)

    target_nodes = [n for n in graph.nodes if n.op == "call_module" and n.target in targets]
    called = {n.target for n in target_nodes}
    missing = {t: _why_missing(t, tracer, rewriter, failed, ignored) for t in targets if t not in called}
    uncalled = [t for t, why in missing.items() if why == _NEVER_CALLED]
    skipped: list[str] = []
    if skip_uncalled_targets and uncalled and len(uncalled) < len(targets):
        skipped = uncalled
        for t in uncalled:
            del targets[t], missing[t]
        notes.append(f"{len(uncalled)} sequential target(s) not run by these inputs, left out: "
                     f"{_name_ranges(uncalled)}")
    if missing:
        raise SwallowedTargetsError(_swallowed_message(missing))
    if cut == "before":
        groups = _groups_by_input(target_nodes)
    else:
        groups = [target_nodes[i:i + targets_per_subgraph] for i in range(0, len(target_nodes), targets_per_subgraph)]

    attrs = {n.target: resolve_attr(model, tracer.constants, n.target) for n in graph.nodes
             if n.op in ("get_attr", "call_module")}
    graph_module = fx.GraphModule(attrs, graph, class_name=f"{type(model).__name__}Traced")
    subgraphs = partition(graph, model, tracer.constants, groups, cut=cut)
    if cut == "before":
        _check_entries_cached(subgraphs)
    leaves = sorted(n for n in tracer.visited if n and tracer.is_leaf_module(model.get_submodule(n), n))
    return TraceResult(
        model=model, graph_module=graph_module, subgraphs=subgraphs, target_names=list(targets),
        input_names=[n.name for n in graph.nodes if n.op == "placeholder"], concrete_args=concrete,
        wrapped=rewriter.records, failed_modules=dict(failed),
        unvisited_modules=_unvisited(model, tracer.visited, set(leaves)), leaf_modules=leaves,
        opaque_calls=[OpaqueCall(n.name, f"{getattr(n.target, '__module__', '')}.{getattr(n.target, '__name__', n.target)}")
                      for n in graph.nodes if n.meta.get("is_wrapped")],
        output_type=tracer.output_type, notes=[*notes, *tracer.notes], skipped_targets=skipped,
        guards=guards.guards, guard_program=guards, patch=chosen, cut=cut)


def _groups_by_input(target_nodes: Sequence[fx.Node]) -> list[list[fx.Node]]:
    """Target calls grouped by the arguments they read (q/k/v share one), in order of first call.

    Each target must be called once: a piece that starts with a target gathers its inputs
    from the cache once, and a second call would read values no piece has cached yet.
    """
    calls: dict[str, int] = {}
    for node in target_nodes:
        calls[str(node.target)] = calls.get(str(node.target), 0) + 1
    repeated = {t: n for t, n in calls.items() if n > 1}
    if repeated:
        shown = ", ".join(f"{t} ({n} calls)" for t, n in list(repeated.items())[:3])
        raise TraceError(f"cutting before each target needs one call per target; called more than once: {shown}. "
                         f"Cut after the blocks instead (cut='after')")
    groups: dict[str, list[fx.Node]] = {}
    for node in target_nodes:
        key = repr(fx.map_arg((node.args, node.kwargs), lambda n: f"%{n.name}"))
        groups.setdefault(key, []).append(node)
    return list(groups.values())


def _check_entries_cached(subgraphs: Sequence[Subgraph]) -> None:
    """Every entry call reads values its piece receives (not a parameter read inside the piece)."""
    for sub in subgraphs:
        inputs = set(sub.input_names)
        for entry in sub.entries:
            missing = [n for n in entry.input_names if n not in inputs]
            if missing:
                raise TraceError(f"target {entry.module!r} reads {missing}, which its piece computes itself, so its "
                                 f"inputs cannot be gathered before the piece runs; cut after the blocks instead")


def _concrete_args(model: torch.nn.Module, sample_inputs: Mapping[str, Any], notes: list[str]) -> dict[str, Any]:
    """Values for forward arguments that are not sample inputs: caches are off while tracing.

    ``use_cache=False`` is pinned when the forward declares it, and also when the forward only
    takes ``**kwargs`` but a submodule's forward declares ``use_cache`` (composite models such
    as Llava forward their kwargs to the language model, which would otherwise build a cache
    from its config while tracing and bake it into the graph).
    """
    if "use_cache" in sample_inputs:
        return {}
    params = forward_signature(model).parameters
    if "use_cache" in params:
        return {"use_cache": False}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {}
    seen: set[type] = set()
    for name, module in model.named_modules():
        if not name or type(module) in seen:
            continue
        seen.add(type(module))
        try:
            declares = "use_cache" in forward_signature(module).parameters
        except (TypeError, ValueError):
            declares = False
        if declares:
            notes.append(f"pinned use_cache=False: {type(model).__name__}.forward takes it only through **kwargs "
                         f"and {type(module).__name__} ({name}) declares it (a cache must not be built while tracing)")
            return {"use_cache": False}
    return {}


def _autowrap(rewriter: ForwardRewriter, module: torch.nn.Module, name: str, exc: BaseException,
              why: str) -> WrappedStatement | str:
    fn = getattr(module.forward, "__func__", None)
    if fn is None:
        return "its forward is not a method"
    code = rewriter.inner_code(fn)
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            line = tb.tb_lineno
        tb = tb.tb_next
    if line is None:
        return "the failure is not in the forward's own code (a decorator, hook or helper around it)"
    return rewriter.wrap(fn, line, why, name)


def _loosen(graph: fx.Graph, guards: list[Guard]) -> list[Guard]:
    """Result guards relaxed where nothing in the graph depends on the difference.

    A mask builder may return a tensor on meta and ``None`` for a real unpadded batch; when
    the mask only flows into an attention kernel or a layer (which test it themselves at run
    time), the graph is right either way (``Tensor?``). An item nothing reads may be anything
    (``*``). A torch op reading the value keeps the guard strict.
    """
    nodes = {n.name: n for n in graph.nodes}
    out = []
    for guard in guards:
        node = nodes.get(guard.node)
        if guard.kind == "result" and node is not None and "lw_meta" in node.meta:
            guard = dataclasses.replace(guard, expected=_pattern(node, node.meta["lw_meta"]))
            node.meta["lw_guard"] = guard
        out.append(guard)
    return out


def _pattern(node: fx.Node, meta: Any) -> Any:
    if isinstance(meta, torch.Tensor):
        return kinds.TENSOR_OR_NONE if _read_opaquely(node.users) else kinds.TENSOR
    exact = kinds.kind_of(meta)
    if isinstance(exact, str):
        return exact
    items = [u for u in node.users if u.op == "call_function" and u.target in (operator.getitem, getattr)]
    if not _read_opaquely([u for u in node.users if u not in items]):
        return exact
    by_key = {u.args[1]: u for u in items}

    def item(key: Any, value: Any) -> Any:
        if value is None:  # the code was handed Python's None and took its "is None" path: strict
            return kinds.NONE
        return _pattern(by_key[key], value) if key in by_key else kinds.ANY

    name, kinds_ = exact
    if name in ("tuple", "list"):
        return (name, tuple(item(i, v) for i, v in enumerate(meta)))
    keys = [k for k, _ in kinds_]
    values = meta.values() if name == "dict" else [getattr(meta, k) for k in keys]
    return (name, tuple((k, item(k, v)) for k, v in zip(keys, values)))


def _read_opaquely(users: Iterable[fx.Node]) -> bool:
    """Do only modules, opaque calls and the output read these users' value (or nothing live)?"""
    for user in users:
        if user.op in ("call_module", "output") or user.meta.get("is_wrapped") or _is_opaque(user.target):
            continue
        if is_pure(user) and not user.users:
            continue  # a dead probe (tracing looked at it; nothing computes with it)
        return False
    return True


def _is_opaque(target: Any) -> bool:
    return any(hasattr(target, a) for a in ("__layerwise_stmt__", "__layerwise_opaque__")) or isinstance(
        target, GuardedCall)


def _check_results_inline(graph: fx.Graph) -> None:
    """Every guarded opaque call checks its result's kind where it runs (even behind a target)."""
    for node in graph.nodes:
        guard = node.meta.get("lw_guard")
        if guard is not None and node.op == "call_function" and not isinstance(node.target, GuardedCall):
            node.target = GuardedCall(node.target, guard)


def _rebuild_output(graph: fx.Graph, output_type: type) -> None:
    def build(fields: dict[str, Any]) -> Any:
        return output_type(**fields)

    build.__name__ = build.__qualname__ = f"build_{output_type.__name__}"
    output = next(n for n in graph.nodes if n.op == "output")
    with graph.inserting_before(output):
        rebuilt = graph.call_function(build, (output.args[0],))
    output.args = (rebuilt,)


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [""] + [".".join(parts[:i]) for i in range(1, len(parts))]


def _unvisited(model: torch.nn.Module, visited: set[str], leaves: set[str]) -> list[str]:
    """Modules whose forward never ran while tracing (and that do not sit inside a called leaf)."""
    out = []
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict)
    for name, module in model.named_modules():
        if name and not isinstance(module, containers) and name not in visited and not any(a in leaves for a in _ancestors(name)):
            out.append(name)
    return out


_NEVER_CALLED = "never called by the forward with these inputs"


def _why_missing(target: str, tracer: LayerwiseTracer, rewriter: ForwardRewriter, failed: Mapping[str, str],
                 ignored: Mapping[str, Any]) -> str:
    """Why ``target`` has no call of its own in the graph."""
    anc = _ancestors(target)
    leaf = next((a for a in reversed(anc) if a in tracer.leaf_names and a), None)
    stmts = [r for r in rewriter.records if r.module in anc]
    if leaf is not None and leaf in failed:
        return f"inside module {leaf!r}, made a leaf because it failed to trace: {failed[leaf]}"
    if leaf is not None:
        return f"inside module {leaf!r}, which is {'ignored' if leaf in ignored else 'a leaf'}"
    if stmts:
        return "swallowed by wrapped statement(s): " + "; ".join(str(r) for r in stmts)
    if target not in tracer.visited:
        return _NEVER_CALLED
    return "called inside an opaque function"


def _swallowed_message(missing: Mapping[str, str]) -> str:
    reasons = "\n".join(f"  {target}: {why}" for target, why in missing.items())
    if all(why == _NEVER_CALLED for why in missing.values()):
        return ("sequential targets are not run by these inputs, so they cannot be calibrated with them:\n" + reasons +
                "\nFix: give inputs that run them (e.g. images for a vision tower), or leave them out of "
                "sequential_targets")
    return ("sequential targets do not appear as their own call in the traced graph, so they cannot be "
            "calibrated one at a time:\n" + reasons +
            "\nFix: " + ("call the untraceable function in that statement opaquely (ModelPatch.opaque_functions), "
                        if any(why.startswith("swallowed by wrapped") for why in missing.values()) else "") +
            "make the swallowing code traceable (a ModelPatch override), stop ignoring it, "
            "or choose other sequential_targets")


def _name_ranges(names: Sequence[str]) -> str:
    """``a.0, a.1, a.2, b.0`` -> ``a.0-2, b.0`` (numbered siblings folded)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        prefix, _, last = name.rpartition(".")
        key = prefix if last.isdigit() else name
        groups.setdefault(key, []).append(last if last.isdigit() else "")
    parts = []
    for key, items in groups.items():
        if items == [""]:
            parts.append(key)
        elif len(items) > 2 and [int(i) for i in items] == list(range(int(items[0]), int(items[-1]) + 1)):
            parts.append(f"{key}.{items[0]}-{items[-1]}")
        else:
            parts.extend(f"{key}.{i}" if i else key for i in items)
    return ", ".join(parts)
