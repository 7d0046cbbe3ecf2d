"""TraceResult: the traced graph, its subgraphs, what was made opaque and why, and checks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from ..errors import LayerwiseError
from .autowrap import WrappedStatement
from .guards import Guard, GuardProgram, GuardViolation
from .partition import OUTPUT_NAME, Subgraph


class TraceError(LayerwiseError, RuntimeError):
    """The forward could not be traced (the message names the module and the statement)."""


class SwallowedTargetsError(TraceError):
    """Sequential targets that do not appear as their own call in the graph."""


class VerifyError(LayerwiseError, RuntimeError):
    """The replayed subgraphs cannot be compared with the plain forward."""


@dataclass
class OpaqueCall:
    """A helper function the graph calls as one node (mask builders, kernels)."""

    node: str
    function: str


@dataclass
class TraceResult:
    """Everything a trace produced; see :func:`layerwise.tracing.trace`."""

    model: torch.nn.Module
    graph_module: fx.GraphModule
    subgraphs: list[Subgraph]
    target_names: list[str]
    input_names: list[str]
    concrete_args: dict[str, Any]
    wrapped: list[WrappedStatement] = field(default_factory=list)
    failed_modules: dict[str, str] = field(default_factory=dict)
    unvisited_modules: list[str] = field(default_factory=list)
    leaf_modules: list[str] = field(default_factory=list)
    opaque_calls: list[OpaqueCall] = field(default_factory=list)
    output_type: type | None = None
    #: what the tracer decided beyond plain tracing, and why (pinned arguments, baked inputs, ...)
    notes: list[str] = field(default_factory=list)
    #: targets these inputs never run, left out under ``skip_uncalled_targets`` (a vision tower on text)
    skipped_targets: list[str] = field(default_factory=list)
    #: decisions the graph took on values that can differ per batch (checked by ``replay``)
    guards: list[Guard] = field(default_factory=list)
    guard_program: GuardProgram | None = field(default=None, repr=False)
    #: the model patch the trace used (``None``: none)
    patch: Any = None
    #: ``"after"``: each subgraph ends with its targets; ``"before"``: each starts with them
    cut: str = "after"

    # ---- guards ---------------------------------------------------------------------
    def check_guards(self, inputs: Mapping[str, Any]) -> None:
        """Raise :class:`GuardViolation` when ``inputs`` break an assumption of this graph."""
        broken = self.guard_violation(inputs)
        if broken is not None:
            raise GuardViolation(*broken)

    def guard_violation(self, inputs: Mapping[str, Any]) -> tuple[Guard, Any] | None:
        """The first guard ``inputs`` break and what they gave instead (``None``: all hold)."""
        return None if self.guard_program is None else self.guard_program.first_violation(inputs)

    # ---- replay ---------------------------------------------------------------------
    def replay(self, inputs: Mapping[str, Any],
               onloaded: Callable[[list[str]], AbstractContextManager[Any]] | None = None,
               guards_checked: bool = False) -> Any:
        """Check the guards, then run the subgraphs one after another, freeing values after their last consumer.

        ``onloaded(modules)`` (e.g. :meth:`ModuleOffloader.onloaded`) is entered around each
        subgraph, so a model whose weights rest elsewhere runs piece by piece; then pass
        ``guards_checked=True`` once the inputs were checked where they rest (the guards' own
        program runs the first layers with the weights where they are).
        """
        if not guards_checked:
            self.check_guards(inputs)
        values: dict[str, Any] = dict(inputs)
        for sub in self.subgraphs:
            with onloaded(sub.onload_names) if onloaded is not None else contextlib.nullcontext():
                values.update(sub.run(values))
            for name in sub.consumed_names:
                values.pop(name, None)
        return values[OUTPUT_NAME]

    @torch.no_grad()
    def verify(self, inputs: Mapping[str, Any], relative: bool = False) -> float:
        """Max abs difference between the replayed subgraphs and ``model(**inputs)`` (``relative``: over
        the largest output value).

        Every tensor in the model output is compared (logits, last_hidden_state, ...).
        """
        if any(p.is_meta for p in self.model.parameters()):
            raise VerifyError("the model's weights are on the meta device; load or materialise them to verify")
        expected = self.model(**inputs, **self.concrete_args)
        return output_difference(expected, self.replay(inputs), relative=relative)

    # ---- views ----------------------------------------------------------------------
    def subgraph_of(self) -> dict[str, int]:
        """Graph node name -> index of the subgraph that computes it."""
        return {name: sub.index for sub in self.subgraphs for name in sub.node_names}

    def to_networkx(self):
        """The traced graph as a ``networkx.DiGraph`` (node attrs: op, target, subgraph)."""
        import networkx as nx

        where = self.subgraph_of()
        graph = nx.DiGraph()
        for node in self.graph_module.graph.nodes:
            graph.add_node(node.name, op=node.op, target=_label(node), subgraph=where.get(node.name))
            for src in node.all_input_nodes:
                graph.add_edge(src.name, node.name)
        return graph

    def to_dot(self) -> str:
        """Graphviz DOT text: one coloured cluster per subgraph, module calls as single boxes."""
        palette = ["#cfe8fc", "#fde2c8", "#d5f5d5", "#f5d5f0", "#fff3b0", "#e0d5f5", "#d5f0f0", "#f5d5d5"]
        where = self.subgraph_of()
        targets = set(self.target_names)
        lines = ["digraph trace {", "  rankdir=TB;", '  node [shape=ellipse, fontsize=10, style=filled];']
        members: dict[int | None, list[fx.Node]] = {}
        for node in self.graph_module.graph.nodes:
            members.setdefault(where.get(node.name), []).append(node)
        for index, nodes in members.items():
            indent = "  "
            if index is not None:
                lines.append(f'  subgraph cluster_{index} {{ label="subgraph {index}"; style=filled; '
                             f'color="{palette[index % len(palette)]}";')
                indent = "    "
            for node in nodes:
                shape = "box" if node.op == "call_module" else "ellipse"
                bold = ", penwidth=3" if node.op == "call_module" and node.target in targets else ""
                label = _label(node).replace('"', "'")
                lines.append(f'{indent}"{node.name}" [label="{label}", shape={shape}, fillcolor=white{bold}];')
            if index is not None:
                lines.append("  }")
        for node in self.graph_module.graph.nodes:
            for src in node.all_input_nodes:
                lines.append(f'  "{src.name}" -> "{node.name}";')
        lines.append("}")
        return "\n".join(lines) + "\n"

    def summary(self) -> str:
        """The table the CLI prints: subgraph, targets, nodes, inputs consumed."""
        rows = [("subgraph", "target", "nodes", "inputs consumed")]
        for sub in self.subgraphs:
            rows.append((str(sub.index), ", ".join(sub.target_names) or "(rest)", str(sub.num_nodes),
                         ", ".join(sub.consumed_names) or "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}" for r in rows)


def output_difference(expected: Any, got: Any, relative: bool = False) -> float:
    """Max abs difference over every tensor of two model outputs (``relative``: over the largest |expected|).

    Raises :class:`VerifyError` when ``got`` lacks a tensor of ``expected`` or a shape differs.
    """
    want, have = _tensor_leaves(expected), _tensor_leaves(got)
    if not want:
        raise VerifyError(f"the model output ({type(expected).__name__}) holds no tensors to compare")
    missing = sorted(set(want) - set(have))
    if missing:
        raise VerifyError(f"replayed output lacks {missing} of the plain forward's output")
    diff, scale = 0.0, 0.0
    for key, tensor in want.items():
        other = have[key]
        if tensor.shape != other.shape:
            raise VerifyError(f"output {key}: shape {tuple(other.shape)} replayed vs {tuple(tensor.shape)}")
        if tensor.numel():  # in float64, one copy of each side (the logits of a calibration batch are large)
            reference = tensor.to(torch.float64, copy=True)  # copies: changed in place below
            delta = other.to(device=tensor.device, dtype=torch.float64, copy=True)
            diff = max(diff, delta.sub_(reference).abs_().max().item())
            scale = max(scale, reference.abs_().max().item())
    return diff / max(scale, 1e-30) if relative else diff


def _label(node: fx.Node) -> str:
    if node.op in ("call_module", "get_attr", "placeholder"):
        return str(node.target)
    target = node.target
    return getattr(target, "__name__", str(target))


def _tensor_leaves(value: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Path -> tensor for every tensor in a (nested) model output; ``None`` fields skipped."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(value, torch.Tensor):
        out[prefix or "."] = value
    elif isinstance(value, Mapping):  # ModelOutput is an OrderedDict of its non-None fields
        for key, item in value.items():
            out.update(_tensor_leaves(item, f"{prefix}.{key}"))
    elif isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            out.update(_tensor_leaves(item, f"{prefix}[{i}]"))
    return out
