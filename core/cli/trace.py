"""``layerwise trace``: trace a local model folder and show its subgraphs (``attempt_trace``).

Wire-up: ``add_parser(subparsers)`` registers the subcommand, ``run(args)`` executes it.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from layerwise.errors import LayerwiseError
from layerwise.model_io.load_errors import explained
from layerwise.tracing.targets import (
    TargetChoice,
    check_entries,
    choose_targets,
    describe_modules,
    resolve_modules,
)

_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``trace`` on an ``argparse`` subparsers object."""
    parser = subparsers.add_parser(
        "trace", help="trace a model into per-target subgraphs and report what was wrapped or failed",
        description="Trace a local model folder (config.json; weights optional: built on meta when absent).")
    parser.add_argument("--model", required=True, help="local folder holding config.json (and optionally weights)")
    parser.add_argument("--modality", choices=["text", "image", "audio"], default=None,
                        help="which sample inputs to build (default: guessed from the config)")
    parser.add_argument("--targets", nargs="+", default=None,
                        help="sequential targets: class names or 're:<regex>' "
                             "(default: patch, else _no_split_modules, else repeated blocks found by structure)")
    parser.add_argument("--ignore", nargs="+", default=None, help="modules kept as single calls")
    parser.add_argument("--targets-per-subgraph", type=int, default=1)
    parser.add_argument("--no-robust", action="store_true", help="fail instead of making untraceable modules leaves")
    parser.add_argument("--verify", action="store_true",
                        help="replay the subgraphs and print the max abs diff (random seeded weights if none saved)")
    parser.add_argument("--graph", default=None, help="write the graph: out.dot, or out.svg/out.png (needs graphviz)")
    parser.add_argument("--suggest-patch", action="store_true",
                        help="after tracing, print a ready-to-paste ModelPatch(...) for the traced blocks")
    parser.set_defaults(func=run)
    return parser


def load_for_tracing(path: str | Path, materialise: bool) -> torch.nn.Module:
    """The model in ``path``: its weights if saved, else random seeded weights or meta tensors."""
    import transformers

    from layerwise.errors import ModelLoadError

    folder = Path(path).expanduser()
    if not folder.exists():
        raise ModelLoadError(f"model folder {str(path)!r} does not exist (trace reads local folders only)")
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{str(path)!r} has no config.json: pass a local model folder saved by "
                             f"transformers (save_pretrained)")
    with explained(str(folder)):
        config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
    names = list(getattr(config, "architectures", None) or [])
    cls = next((getattr(transformers, n) for n in names if hasattr(transformers, n)), None)
    has_weights = any(any(folder.glob(g)) for g in _WEIGHT_GLOBS)
    if cls is None:  # config saved without architectures: the first auto class that knows it
        order = ("AutoModelForCausalLM", "AutoModelForSeq2SeqLM", "AutoModelForSpeechSeq2Seq", "AutoModel")
        if getattr(config, "is_encoder_decoder", False):
            order = order[1:]
        for auto in order:
            mapping = getattr(transformers, auto)._model_mapping
            if type(config) in mapping:
                cls = mapping[type(config)]
                break
        else:
            raise ValueError(f"no transformers model class for {type(config).__name__}; set 'architectures' in config.json")
    if has_weights:
        with explained(str(folder)):
            model = cls.from_pretrained(folder, local_files_only=True, dtype=torch.float32, trust_remote_code=False)
    elif materialise:
        torch.manual_seed(0)
        model = cls(config)
    else:
        with torch.device("meta"):
            model = cls(config)
    return model.eval()


def _find_patch(model: torch.nn.Module) -> Any:
    """The registered model patch for ``model`` (``None`` when none matches or plugins fail)."""
    try:
        from layerwise.host.patch_selection import find_patch

        return find_patch(model)
    except Exception:  # noqa: BLE001 - tracing works without a patch
        return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)}"
    return repr(value)


#: the replayed subgraphs must match the plain forward within this (fp32 weights)
VERIFY_TOLERANCE = 1e-5


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Execute ``layerwise trace``; 0 on success, 1 when the trace or verification fails."""
    from layerwise.common.quiet import command_line_bars
    from layerwise.host.patch_selection import apply_patch
    from layerwise.host.versions import warn_if_untested
    from layerwise.tracing import trace
    from layerwise.tracing.result import TraceError
    from layerwise.tracing.samples import default_modality, sample_inputs

    out = out or sys.stdout
    # before the model loads and traces: the file --graph writes is new and outside the model folder
    graph = graph_file(args.graph, args.model) if args.graph else None
    command_line_bars(True)  # transformers' loading bar: a line per redraw in a pipe or a log
    warn_if_untested()
    model = load_for_tracing(args.model, materialise=args.verify)
    patch = _find_patch(model)
    warn_if_untested(patch)
    apply_patch(model, patch)
    modality = args.modality or default_modality(model.config)
    try:
        if patch is not None and patch.sample_inputs is not None:
            inputs = patch.sample_inputs(model.config, modality)
        else:
            inputs = sample_inputs(model.config, modality)
    except ValueError as exc:  # a modality the model does not take
        print(f"Cannot build {modality} inputs for {type(model).__name__}: {exc}", file=out)
        return 1
    choice = choose_targets(model, args.targets, patch)  # a --targets typo is an error (exit 2)
    targets = list(choice.targets) or None
    if args.ignore is not None:
        check_entries(model, args.ignore, "ignore entry")
    ignore = args.ignore if args.ignore is not None else (list(patch.ignore) if patch is not None else None)
    weights = "saved weights" if any(any(Path(args.model).glob(g)) for g in _WEIGHT_GLOBS) else (
        "random seeded weights" if args.verify else "meta tensors, no weights")
    print(f"Model: {type(model).__name__} ({weights}); patch: {patch.name if patch is not None else 'none'}",
          file=out)
    print(f"Inputs ({modality}): " + ", ".join(f"{k} {_describe(v)}" for k, v in inputs.items()), file=out)
    print(_targets_line(model, choice), file=out)
    try:
        result = trace(model, inputs, sequential_targets=targets, ignore=ignore,
                       targets_per_subgraph=args.targets_per_subgraph, robust=not args.no_robust,
                       skip_uncalled_targets=not args.targets, patch=patch or False)
    except (TraceError, ValueError) as exc:
        print(f"Tracing {type(model).__name__} failed: {exc}", file=out)
        return 1
    print(f"Traced {type(model).__name__} into {len(result.subgraphs)} subgraphs "
          f"({len(result.target_names)} targets, {args.targets_per_subgraph} per subgraph, + the rest)", file=out)
    print(result.summary(), file=out)
    print(f"Wrapped statements: {len(result.wrapped)}", file=out)
    for rec in result.wrapped:
        print(f"  {rec}", file=out)
    print(f"Failed modules (made leaves): {len(result.failed_modules)}", file=out)
    for name, why in result.failed_modules.items():
        print(f"  {name}: {why}", file=out)
    if result.opaque_calls:
        print("Opaque calls: " + ", ".join(sorted({c.function for c in result.opaque_calls})), file=out)
    print(f"Guards (decisions a batch must keep, checked before it runs): {len(result.guards)}", file=out)
    for guard in result.guards:
        print(f"  {guard}", file=out)
    if result.notes:
        print("Notes:", file=out)
        for note in result.notes:
            print(f"  {note}", file=out)
    if result.unvisited_modules:
        names = set(result.unvisited_modules)
        outermost = [n for n in result.unvisited_modules
                     if not any(n.startswith(other + ".") for other in names)]
        print("Never called (with what they hold): " + ", ".join(outermost), file=out)
    if graph is not None:
        print(write_graph(result, graph), file=out)
    if args.suggest_patch:
        from layerwise.tracing.suggest import suggest_patch

        print("Suggested patch (a plugin module's start; `layerwise new-patch` scaffolds the package and its "
              "test):", file=out)
        print(suggest_patch(model, result.target_names), file=out, end="")
    if args.verify:
        diff = result.verify(inputs)
        verdict = "ok" if diff <= VERIFY_TOLERANCE else "MISMATCH"
        print(f"max abs diff: {diff:.3e} (replayed subgraphs vs the plain forward; {verdict}, "
              f"tolerance {VERIFY_TOLERANCE:.0e})", file=out)
        if diff > VERIFY_TOLERANCE:
            return 1
    return 0


#: how ``layerwise trace`` names each target source (the first three as before discovery existed)
_SOURCE_LABELS = {"given": "--targets", "patch": "patch", "_no_split_modules": "_no_split_modules",
                  "structure": "found by structure"}


def _targets_line(model: torch.nn.Module, choice: TargetChoice) -> str:
    """``Targets (patch): LlamaDecoderLayer``, or what discovery found and where."""
    if choice.source == "none":
        return "Targets: none (no patch, no _no_split_modules, no repeated blocks); pass --targets"
    if choice.source == "structure":
        return (f"Targets (found by structure): {describe_modules(resolve_modules(model, choice.targets))}; "
                "no patch names these blocks (--suggest-patch prints one)")
    return f"Targets ({_SOURCE_LABELS[choice.source]}): {', '.join(choice.targets)}"


#: what ``--graph`` writes, in its errors
GRAPH = "the graph"


@dataclass(frozen=True)
class GraphFile:
    """Where ``--graph`` writes and how, settled before tracing."""

    #: the file written: the one asked for, or its ``.dot`` sibling when graphviz cannot render it
    path: Path
    #: ``dot`` (the DOT text itself), ``svg`` or ``png`` (rendered by graphviz's ``dot``)
    fmt: str
    #: the SVG/PNG asked for when graphviz is missing (``None`` otherwise)
    instead_of: Path | None = None


def graph_file(requested: str, model_folder: str) -> GraphFile:
    """The file ``--graph`` will write, checked now: never an existing file, never inside the model folder.

    An SVG or PNG needs graphviz's ``dot``; without it the DOT text goes to the ``.dot`` name beside it,
    which is checked the same way.
    """
    path = Path(requested)
    fmt = path.suffix.lstrip(".").lower()
    if fmt not in ("svg", "png"):
        fmt = "dot"
    elif shutil.which("dot") is None:
        return GraphFile(_checked(path.with_suffix(".dot"), model_folder), "dot", instead_of=path)
    return GraphFile(_checked(path, model_folder), fmt)


def _checked(path: Path, model_folder: str) -> Path:
    from layerwise.model_io.output_file import check_output_file

    return check_output_file(path, GRAPH, [("model folder", model_folder)])


def write_graph(result: Any, graph: GraphFile) -> str:
    """Write DOT, or render SVG/PNG with graphviz's ``dot``; returns what was written, and where."""
    from layerwise.model_io.output_file import write_output_file

    dot = result.to_dot()
    content: str | bytes = dot if graph.fmt == "dot" else _render(dot, graph.fmt)
    write_output_file(graph.path, content, GRAPH)
    if graph.instead_of is not None:
        return (f"graphviz 'dot' not found (apt install graphviz), so {graph.instead_of} was not drawn; "
                f"the graph's DOT text was written to {graph.path} instead")
    return f"Graph written to {graph.path}"


def _render(dot: str, fmt: str) -> bytes:
    """The graph drawn by graphviz's ``dot`` as ``fmt`` (``svg``, ``png``)."""
    done = subprocess.run([shutil.which("dot") or "dot", f"-T{fmt}"], input=dot.encode(), capture_output=True)
    if done.returncode != 0:
        raise GraphRenderError(f"graphviz 'dot' could not draw the graph as {fmt} (exit status {done.returncode}: "
                               f"{done.stderr.decode(errors='replace').strip()[:300]}); write DOT instead "
                               f"(--graph FILE.dot) and render it yourself")
    return done.stdout


class GraphRenderError(LayerwiseError):
    """graphviz's ``dot`` failed to draw the traced graph."""


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m layerwise.cli.trace``) until ``layerwise`` wires it in."""
    parser = argparse.ArgumentParser(prog="layerwise")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
