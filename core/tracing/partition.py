"""Cutting a traced graph into one executable subgraph per target group, plus the rest.

Two ways to cut (``cut``):

* ``"after"`` (blocks): each target group's subgraph holds the group's target calls and
  every not-yet-placed node they depend on; the final subgraph holds what is left (head,
  output). A piece *ends* with its targets.
* ``"before"`` (layers): the first subgraph computes what the first group reads; every later
  one *starts* with a group's target calls and computes what the next group reads; the last
  holds the last group and the rest. A piece's entry targets read values the previous piece
  produced, so their statistics come from the cache without running anything
  (:attr:`Subgraph.entries`).

Values cross subgraph boundaries by node name, so a pipeline can cache them by name and
free each after its last consumer.

What a piece needs on the execution device (:attr:`Subgraph.onload_names`): the modules it calls,
plus every parameter and buffer it reads itself (a ``get_attr``), named one by one where its owner
is a container whose layers other pieces call (BERT's ``embeddings.token_type_ids``, a vision
tower's ``class_embedding``). Tensors the tracer captured as constants follow the piece's inputs
to their device when it runs.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

#: name of the single value the final subgraph produces: the model's output
OUTPUT_NAME = "output"
#: where a piece is cut relative to its targets: after their calls (blocks) or before (layers)
CUTS = ("after", "before")


@dataclass(frozen=True)
class EntryCall:
    """A target call a piece starts with, its arguments named by the values that hold them."""

    module: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    @classmethod
    def of(cls, node: fx.Node) -> EntryCall:
        return cls(str(node.target), fx.map_arg(node.args, _ValueRef.of), fx.map_arg(node.kwargs, _ValueRef.of))

    @property
    def input_names(self) -> list[str]:
        names: list[str] = []
        fx.node.map_aggregate((self.args, self.kwargs),
                              lambda v: names.append(v.name) if isinstance(v, _ValueRef) else None)
        return names

    def bind(self, values: Mapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's real arguments, read from ``values`` (a piece's inputs)."""
        def real(value: Any) -> Any:
            return values[value.name] if isinstance(value, _ValueRef) else value

        return fx.node.map_aggregate(self.args, real), fx.node.map_aggregate(self.kwargs, real)


@dataclass(frozen=True)
class _ValueRef:
    name: str

    @classmethod
    def of(cls, node: fx.Node) -> _ValueRef:
        return cls(node.name)


@dataclass
class Subgraph:
    """One executable piece of the model: named values in, named values out."""

    index: int
    module: fx.GraphModule
    input_names: list[str]
    output_names: list[str]
    consumed_names: list[str]
    target_names: list[str]
    modules: list[str]
    num_nodes: int = 0
    node_names: list[str] = field(default_factory=list, repr=False)
    #: the target calls this piece starts with (``cut="before"`` only), in graph order
    entries: list[EntryCall] = field(default_factory=list)
    #: parameters and buffers of the model the piece reads itself (``get_attr``), by qualified name
    attributes: list[str] = field(default_factory=list)
    #: tensors the tracer captured as constants (attributes of :attr:`module`): moved to the inputs' device
    constant_tensors: list[str] = field(default_factory=list, repr=False)
    #: nodes whose arguments hold a ``torch.device`` the trace met as a value (a model's ``self.device``, read
    #: where the weights rested while it was traced): pointed at the inputs' device, as the constants are
    device_nodes: list[str] = field(default_factory=list, repr=False)
    #: the device :attr:`device_nodes` point at now (``None``: as traced, not yet checked)
    _devices_at: torch.device | None = field(default=None, init=False, repr=False)

    @property
    def onload_names(self) -> list[str]:
        """What must be on the execution device while the piece runs: its modules (whole subtrees), and the
        parameters and buffers it reads whose owner is not among them (a container called elsewhere)."""
        inside = [a for a in self.attributes if not any(a.startswith(m + ".") or not m for m in self.modules)]
        return [*self.modules, *inside]

    def run(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Outputs of this piece from ``values`` (a mapping holding at least ``input_names``)."""
        missing = [n for n in self.input_names if n not in values]
        if missing:
            raise KeyError(f"subgraph {self.index} needs values {missing} that are not in the cache; "
                           "run the subgraphs in order and keep values until their consumed_names says so")
        args = [values[n] for n in self.input_names]
        if self.constant_tensors or self.device_nodes:
            device = _first_device(args)
            self._constants_to(device)
            self._devices_to(device)
        return self.module(*args)

    def _devices_to(self, device: torch.device | None) -> None:
        """The device values in :attr:`device_nodes`' arguments set to ``device`` (the graph recompiled once per
        device change). A piece traced while the weights rested on the CPU and replayed on a GPU would else
        move a value back to the CPU where the model's code says ``.to(self.device)`` (Idefics3's embeddings)."""
        if device is None or not self.device_nodes or device == self._devices_at:
            return  # every batch of a piece runs here: the graph is walked once per device, not per batch
        self._devices_at = device

        def moved(value: Any) -> Any:
            return device if isinstance(value, torch.device) and value != device else value

        changed = False
        for node in self.module.graph.nodes:
            if node.name in self.device_nodes:
                args, kwargs = fx.node.map_aggregate(node.args, moved), fx.node.map_aggregate(node.kwargs, moved)
                if args != node.args or kwargs != node.kwargs:
                    node.args, node.kwargs, changed = args, kwargs, True
        if changed:
            self.module.recompile()

    def _constants_to(self, device: torch.device | None) -> None:
        """The captured constant tensors on ``device`` (where the inputs are); moved once per device change."""
        if device is None:
            return
        for name in self.constant_tensors:
            value = getattr(self.module, name)
            if value.device != device:
                setattr(self.module, name, value.to(device))


def resolve_attr(root: Any, constants: Mapping[str, Any], target: str) -> Any:
    """What a graph's ``get_attr``/``call_module`` target names: a tracer constant or a model attribute."""
    if target in constants:
        return constants[target]
    obj = root
    for part in filter(None, target.split(".")):  # "" names the root itself
        obj = getattr(obj, part)
    return obj


def partition(graph: fx.Graph, model: torch.nn.Module, constants: Mapping[str, Any],
              groups: Sequence[Sequence[fx.Node]], cut: str = "after") -> list[Subgraph]:
    """``len(groups) + 1`` subgraphs, cut after (or before) each target group, in graph order."""
    if cut not in CUTS:
        raise ValueError(f"cut must be one of {CUTS}, got {cut!r}")
    before = cut == "before"
    after_effects = _after_effects(graph)
    assign: dict[fx.Node, int] = {}
    for index, group in enumerate(groups):
        if before:  # the previous group opens this piece; what this group reads closes it
            for node in groups[index - 1] if index else ():
                assign.setdefault(node, index)
            stack = [src for node in group for src in node.all_input_nodes]
        else:
            stack = list(group)
        while stack:
            node = stack.pop()
            if node in assign or node.op in ("placeholder", "get_attr"):
                continue
            assign[node] = index
            stack.extend(node.all_input_nodes)
            stack.extend(after_effects.get(node, ()))
    last = len(groups)
    if before and groups:
        for node in groups[-1]:
            assign.setdefault(node, last)
    for node in graph.nodes:
        if node.op not in ("placeholder", "get_attr") and node not in assign:
            assign[node] = last

    count = last + 1
    inputs: list[list[fx.Node]] = [[] for _ in range(count)]
    outputs: list[list[fx.Node]] = [[] for _ in range(count)]
    last_use: dict[fx.Node, int] = {}
    for node in graph.nodes:
        if node not in assign:
            continue
        here = assign[node]
        for src in node.all_input_nodes:
            if src.op == "get_attr" or assign.get(src) == here:
                continue
            if src not in inputs[here]:
                inputs[here].append(src)
            last_use[src] = max(last_use.get(src, here), here)
            if src.op != "placeholder" and src not in outputs[assign[src]]:
                outputs[assign[src]].append(src)

    group_targets = [[str(n.target) for n in group] for group in groups]
    group_targets = [[], *group_targets] if before else [*group_targets, []]
    entries = [[], *([EntryCall.of(n) for n in group] for group in groups)] if before else [[]] * count
    subgraphs = []
    for index in range(count):
        members = [n for n in graph.nodes if assign.get(n) == index]
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for src in inputs[index]:
            env[src] = sub.placeholder(src.name)

        def lookup(node: fx.Node, env: dict[fx.Node, fx.Node] = env, sub: fx.Graph = sub) -> fx.Node:
            if node not in env:  # get_attr: every subgraph fetches its own parameters/constants
                env[node] = sub.node_copy(node)
            return env[node]

        for node in members:
            if node.op == "output":
                sub.output({OUTPUT_NAME: fx.map_arg(node.args[0], lookup)})
                continue
            env[node] = sub.node_copy(node, lookup)
        if index < last:
            sub.output({src.name: env[src] for src in outputs[index]})
            out_names = [src.name for src in outputs[index]]
        else:
            out_names = [OUTPUT_NAME]
        attrs = {n.target: resolve_attr(model, constants, n.target) for n in sub.nodes if n.op in ("get_attr", "call_module")}
        module = fx.GraphModule(attrs, sub, class_name=f"Subgraph{index}")
        called = list(dict.fromkeys(str(n.target) for n in members if n.op == "call_module"))
        read = [str(n.target) for n in sub.nodes if n.op == "get_attr" and not str(n.target).startswith("_lw_")]
        owners = [target.rpartition(".")[0] for target in read]
        constant_tensors = [str(n.target) for n in sub.nodes if n.op == "get_attr" and str(n.target).startswith("_lw_")
                            and isinstance(getattr(module, str(n.target), None), torch.Tensor)]
        subgraphs.append(Subgraph(
            index=index, module=module, input_names=[n.name for n in inputs[index]], output_names=out_names,
            consumed_names=[n.name for n, i in last_use.items() if i == index],
            target_names=group_targets[index],
            modules=list(dict.fromkeys(called + [o for o in owners if o])),
            num_nodes=len(members), node_names=[n.name for n in members], entries=list(entries[index]),
            attributes=list(dict.fromkeys(read)), constant_tensors=constant_tensors,
            device_nodes=[n.name for n in sub.nodes if _holds_device(n)]))
    return _without_containers(subgraphs)


def _holds_device(node: fx.Node) -> bool:
    """Does ``node`` take a ``torch.device`` value among its arguments (a device the trace read, now a literal)?"""
    found: list[bool] = []

    def visit(value: Any) -> Any:
        if isinstance(value, torch.device):
            found.append(True)
        return value

    fx.node.map_aggregate((node.args, node.kwargs), visit)
    return bool(found)


def _first_device(values: Any) -> torch.device | None:
    """The device of the first tensor in ``values`` (nested containers searched), or ``None``."""
    found: list[torch.device] = []

    def visit(value: Any) -> Any:
        if not found and isinstance(value, torch.Tensor):
            found.append(value.device)
        return value

    fx.node.map_aggregate(values, visit)
    return found[0] if found else None


def _after_effects(graph: fx.Graph) -> dict[fx.Node, list[fx.Node]]:
    """Node -> the in-place operations it must follow (``out.index_add_(...)`` before ``out.reshape()``).

    An in-place call whose result nobody uses has no edge to the nodes that read what it
    changed; without one it would land in the last piece, after its readers ran (a mixture
    of experts summing expert outputs into a buffer would read zeros).
    """
    deps: dict[fx.Node, list[fx.Node]] = {}
    pending: dict[fx.Node, list[fx.Node]] = {}  # mutated value -> effects on it so far
    for node in graph.nodes:
        for value in node.all_input_nodes:
            for effect in pending.get(value, ()):
                if effect is not node:
                    deps.setdefault(node, []).append(effect)
        if node.users or node.op not in ("call_method", "call_function") or is_pure(node):
            continue
        target = node.args[0] if node.args else None
        if isinstance(target, fx.Node):
            pending.setdefault(target, []).append(node)
    return deps


def _without_containers(subgraphs: list[Subgraph]) -> list[Subgraph]:
    """Drop from each ``modules`` list the containers of modules called elsewhere.

    A subgraph that reads an attribute of ``model`` itself (a buffer, a config tensor)
    must not claim all of ``model``: consumers treat ``modules`` as prefixes, and the
    layers inside belong to the subgraphs that call them.
    """
    called = {m for sub in subgraphs for m in sub.modules}
    for sub in subgraphs:
        sub.modules = [m for m in sub.modules if not any(c.startswith(m + ".") for c in called)]
    return subgraphs


def is_pure(node: fx.Node) -> bool:
    """Can ``node`` be dropped when nothing reads it (no in-place op, opaque call or wrapped statement)?"""
    if node.op == "get_attr":
        return True
    if node.op == "call_method":
        return not str(node.target).endswith("_")  # in-place methods (add_, masked_fill_) are effects
    if node.op != "call_function" or node.meta.get("is_wrapped") or hasattr(node.target, "__layerwise_stmt__"):
        return False
    target = node.target
    if target in (operator.getitem, getattr) or getattr(target, "__module__", None) == "_operator":
        return not getattr(target, "__name__", "").startswith("i")  # iadd & co. mutate
    name = getattr(target, "__name__", "")
    module = getattr(target, "__module__", "") or ""
    return module.startswith("torch") and not name.endswith("_") and not node.is_impure()


def eliminate_dead_pure_nodes(graph: fx.Graph) -> None:
    """Drop unused side-effect-free nodes that tracing left behind (shape probes, dead branches)."""
    for node in reversed(list(graph.nodes)):
        if not node.users and is_pure(node):
            graph.erase_node(node)
