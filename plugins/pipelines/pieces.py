"""Where ``sequential`` cuts the model: before the layers modifiers read, or after each block.

The layer cut is traced first (one trace per kind of batch, :mod:`layerwise.tracing.retrace`)
and used only where it is exact: the model traces that finely, every modifier reads nothing but
layer inputs, and the first batch replayed through the layer pieces equals the model's own
output. The block cut is traced only when the layer cut is not used (or, for a model whose
weights are streamed or offloaded, to compare against). The choice and its reason are recorded
on the run's state.

The cut is a property of the model and the recipe, never of the device: a layer cut that fails
because a tensor sat on the wrong device (the execution device apart from where the weights
rest) is a bug, and falling back to blocks says so with a
:class:`~layerwise.runtime.devices.DeviceErrorWarning` (``pieces="layers"`` makes it an error).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from layerwise.plugin import InvalidArgumentError, Lifecycle, warn_user
from layerwise.plugin.pipelines import (
    DeviceErrorWarning,
    ModuleOffloader,
    PipelineFailed,
    PipelineOptions,
    TracesByGuards,
    blocks_reason,
    device_error_note,
    is_device_error,
    move_to,
    output_difference,
)

from ._common import FATAL_ERRORS, all_module_names


def trace_for_pipeline(model: torch.nn.Module, sample: dict[str, Any], options: PipelineOptions,
                       lifecycle: Lifecycle, layers: Sequence[str] | None = None) -> Any:
    """The model's subgraphs for batches like ``sample``; any tracing error becomes :class:`PipelineFailed`.

    With ``layers`` the cut is before each group of those modules (their qualified names),
    else after each sequential target.
    """
    try:
        from layerwise.plugin.pipelines import trace
    except ImportError as exc:  # pragma: no cover - the tracer ships with layerwise
        raise PipelineFailed(f"the tracer is not available: {exc}") from exc
    patch = getattr(lifecycle.state, "patch", None)
    if layers is not None:
        targets, per_subgraph, cut = list(layers), 1, "before"
    else:
        targets, per_subgraph, cut = options.sequential_targets or None, options.targets_per_subgraph, "after"
    try:
        return trace(model, sample, sequential_targets=targets, ignore=options.ignore or None,
                     targets_per_subgraph=per_subgraph, skip_uncalled_targets=True, patch=patch or False, cut=cut)
    except FATAL_ERRORS:
        raise
    except Exception as exc:  # any tracing failure means "try another pipeline"
        raise PipelineFailed(f"tracing failed: {type(exc).__name__}: {exc}") from exc


def traces_for_batches(model: torch.nn.Module, batches: Sequence[dict[str, Any]], options: PipelineOptions,
                       lifecycle: Lifecycle, layers: Sequence[str] | None = None) -> tuple[TracesByGuards, list[int]]:
    """The traces the batches need (one per kind of batch) and which one serves each batch.

    Checked before any modifier sees data: a graph never runs a batch that breaks its guards.
    """
    traces = TracesByGuards(lambda sample: trace_for_pipeline(model, dict(sample), options, lifecycle, layers))
    try:
        assignment = [traces.for_batch(batch, f"batch {i}") for i, batch in enumerate(batches)]
    except (PipelineFailed, *FATAL_ERRORS):
        raise
    except Exception as exc:  # a guard no re-trace could satisfy, or differently cut traces
        raise PipelineFailed(f"tracing failed: {type(exc).__name__}: {exc}") from exc
    return traces, assignment


def _warn_skipped(traces: TracesByGuards, kind: str) -> None:
    """Targets the calibration inputs never run (e.g. a vision tower calibrated on text only)."""
    skipped = traces.traces[0].skipped_targets
    if skipped:
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        warn_user(f"sequential: {len(skipped)} {kind}(s) not run by the calibration inputs ({shown}); "
                  f"modifiers get no samples for them")


def layers_read(model: torch.nn.Module, lifecycle: Lifecycle, options: PipelineOptions) -> tuple[list[str], str]:
    """The modules to cut before (model order) and ``""``, or ``[]`` and why the cut stays at blocks."""
    why_not = blocks_reason(options.pieces, options.propagate_error, options.targets_per_subgraph,
                            lifecycle.modifiers)
    if why_not:
        return [], why_not
    names = all_module_names(model)
    read = lifecycle.calibration_inputs(names)
    if read is None:  # ask each modifier again only to name the ones that need whole forwards
        whole = [type(m).__name__ for m in lifecycle.modifiers if m.calibration_inputs(names) is None]
        return [], f"{', '.join(whole)} needs whole forwards, not only layer inputs"
    if not read:
        return [], "no modifier reads layer inputs"
    return [n for n in names if n in read], ""


#: the largest relative difference between the layers' and the blocks' replay of the first batch
#: that still counts as the same computation (the ops are the same; only kernels' rounding may differ)
SAME_OUTPUT_TOLERANCE = 1e-4


def choose_pieces(model: torch.nn.Module, batches: Sequence[dict[str, Any]], options: PipelineOptions,
                  lifecycle: Lifecycle, device: torch.device) -> tuple[TracesByGuards, list[int], bool]:
    """Traces cut before the layers modifiers read where that is exact, else after the blocks.

    Exact means: the model traces with those layers as targets, every batch fits a trace, and
    the first batch replayed through the layer pieces gives what the model gives (its plain
    forward when its weights rest on the execution device, else the block pieces' replay:
    tracing inside blocks meets code the block trace never sees). The block cut is traced only
    when it is needed. Returns the traces, the batch assignment and whether the cut is at
    layers; the choice and its reason go to ``state.pieces``, and the chosen traces' re-traces
    to ``state.guards_retraced``.
    """
    layers, why_not = layers_read(model, lifecycle, options)
    if not layers and options.pieces == "layers":
        raise InvalidArgumentError(f"pieces='layers' cannot be used: {why_not}. Use pieces='auto' or 'blocks' "
                                   f"(CLI: --pieces auto)")
    blocks: tuple[TracesByGuards, list[int]] | None = None
    if layers:
        try:
            fine, fine_assignment = traces_for_batches(model, batches, options, lifecycle, layers)
            if resident(model, device, options):
                difference = _difference_from_model(model, fine, batches[0], device)
            else:
                blocks = traces_for_batches(model, batches, options, lifecycle)
                difference = _first_batch_difference(model, fine, blocks[0], batches[0], device, options.stream)
        except PipelineFailed as exc:
            why_not = f"cutting before the layers failed ({exc})"
            if is_device_error(exc) and options.pieces != "layers":
                why_not += "; a device error: a bug"
                warn_user(f"sequential: the run is cut at blocks instead of before the layers (each block runs "
                          f"twice, observed then compressed: another algorithm than the layer cut's). "
                          f"{device_error_note('Cutting before the layers')}: {exc}", DeviceErrorWarning)
        else:
            if difference <= SAME_OUTPUT_TOLERANCE:
                _warn_skipped(fine, "layer")
                count = len(fine.traces[0].subgraphs)
                _record(lifecycle, fine, f"layers: {count} pieces cut before the layers modifiers read, "
                                         f"one forward each")
                return fine, fine_assignment, True
            why_not = (f"the layer pieces replay the first batch {difference:.2g} (relative) away from "
                       f"{'the model' if blocks is None else 'the block pieces'}")
        if options.pieces == "layers":
            raise InvalidArgumentError(f"pieces='layers' cannot be used for this model: {why_not}. Use "
                                       f"pieces='auto' (blocks where layers fail) or 'blocks' (CLI: --pieces auto)")
    traces, assignment = blocks if blocks is not None else traces_for_batches(model, batches, options, lifecycle)
    _warn_skipped(traces, "target")
    count = len(traces.traces[0].subgraphs)
    runs = "once" if not options.propagate_error else "twice (observed, then compressed)"
    if any(getattr(m, "needs_reference_inputs", False) for m in lifecycle.modifiers):
        runs += ", and once in the original model (its stream beside the compressed one)"
    _record(lifecycle, traces, f"blocks: {count} pieces, each block runs {runs} ({why_not})")
    return traces, assignment, False


def resident(model: torch.nn.Module, device: torch.device, options: PipelineOptions) -> bool:
    """Does every weight of ``model`` already rest on the execution device (a plain forward moves nothing)?"""
    return options.stream is None and ModuleOffloader(model, device).is_noop()


def _difference_from_model(model: torch.nn.Module, fine: TracesByGuards, batch: dict[str, Any],
                           device: torch.device) -> float:
    """Relative difference between the first batch replayed through the layer pieces and the model's forward."""
    return _replay_or_fail(lambda: fine.traces[0].verify(move_to(dict(batch), device), relative=True))


def _first_batch_difference(model: torch.nn.Module, fine: TracesByGuards, blocks: TracesByGuards,
                            batch: dict[str, Any], device: torch.device, stream: Any = None) -> float:
    """Relative difference of the model output replayed through both cuts (the first batch's trace of each).

    Each cut onloads its pieces with its own targets protected: a block piece onloads the whole
    block, layers included, which the layer cut's offloader would leave where they rest (on a GPU,
    a block then read CPU weights: the layer cut failed there).
    """
    def offloader(traces: TracesByGuards) -> ModuleOffloader:
        targets = {t for result in traces.traces for t in result.target_names}
        return ModuleOffloader(model, device, protected=targets, source=stream)

    by_blocks, by_layers = offloader(blocks), offloader(fine)

    def compare() -> float:
        inputs = move_to(dict(batch), device)  # its guards held: it was assigned to both
        expected = blocks.traces[0].replay(inputs, onloaded=by_blocks.onloaded, guards_checked=True)
        got = fine.traces[0].replay(inputs, onloaded=by_layers.onloaded, guards_checked=True)
        return output_difference(expected, got, relative=True)

    return _replay_or_fail(compare)


def _replay_or_fail(compare: Callable[[], float]) -> float:
    """``compare()``; any failure but a fatal one means the layer cut cannot be used (:class:`PipelineFailed`)."""
    try:
        return compare()
    except FATAL_ERRORS:
        raise
    except Exception as exc:
        raise PipelineFailed(f"replaying the first batch failed: {type(exc).__name__}: {exc}") from exc


def _record(lifecycle: Lifecycle, traces: TracesByGuards, pieces: str) -> None:
    state = lifecycle.state
    if hasattr(state, "pieces"):
        state.pieces = pieces
    if isinstance(getattr(state, "guards_retraced", None), list):
        state.guards_retraced.extend(traces.retraced)
