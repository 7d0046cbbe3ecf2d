"""``sequential``: the traced subgraphs, one after another, with cached intermediates.

The model is traced (the first batch gives the sample shapes) into one subgraph per
sequential target plus the rest. Before any modifier sees data, every batch is checked
against the trace's guards; a batch that breaks one gets a trace of its own
(:mod:`layerwise.tracing.retrace`), cut at the same targets, so each piece runs every
batch through the subgraph of that batch's trace. Every batch flows through subgraph 1, its outputs
go to the intermediates cache, the subgraph's modules are compressed, the subgraph
re-runs with the compressed weights (``propagate_error``) to produce the next
subgraph's inputs, values are freed after their last consumer, and so on. A batch whose
outputs of a piece hold NaN or inf is dropped from the later pieces, with a warning naming it
(:func:`layerwise.finite.drop_if_non_finite`).

Tracing happens before any modifier sees data: a model that cannot be traced fails
with :class:`~layerwise.pipeline.PipelineFailed` and nothing was changed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerwise.cache import IntermediatesCache
from layerwise.finite import drop_if_non_finite
from layerwise.lifecycle import Lifecycle
from layerwise.offload import ModuleOffloader
from layerwise.pipeline import Pipeline, PipelineFailed, PipelineOptions
from layerwise.tracing.retrace import TracesByGuards
from layerwise.user_warnings import warn_user

from ._common import (
    FATAL_ERRORS,
    calibration_hooks_paused,
    calibration_mode,
    execution_device,
    progress,
)


def trace_for_pipeline(model: torch.nn.Module, sample: dict[str, Any], options: PipelineOptions,
                       lifecycle: Lifecycle) -> Any:
    """The model's subgraphs for batches like ``sample``; any tracing error becomes :class:`PipelineFailed`."""
    try:
        from layerwise.tracing import trace
    except ImportError as exc:  # pragma: no cover - the tracer ships with layerwise
        raise PipelineFailed(f"the tracer is not available: {exc}") from exc
    patch = getattr(lifecycle.state, "patch", None)
    try:
        return trace(model, sample, sequential_targets=options.sequential_targets or None,
                     ignore=options.ignore or None, targets_per_subgraph=options.targets_per_subgraph,
                     skip_uncalled_targets=True, patch=patch or False)
    except FATAL_ERRORS:
        raise
    except Exception as exc:  # any tracing failure means "try another pipeline"
        raise PipelineFailed(f"tracing failed: {type(exc).__name__}: {exc}") from exc


def traces_for_batches(model: torch.nn.Module, batches: Sequence[dict[str, Any]], options: PipelineOptions,
                       lifecycle: Lifecycle) -> tuple[TracesByGuards, list[int]]:
    """The traces the batches need (one per kind of batch) and which one serves each batch.

    Checked before any modifier sees data: a graph never runs a batch that breaks its guards.
    """
    traces = TracesByGuards(lambda sample: trace_for_pipeline(model, dict(sample), options, lifecycle))
    try:
        assignment = [traces.for_batch(batch, f"batch {i}") for i, batch in enumerate(batches)]
    except (PipelineFailed, *FATAL_ERRORS):
        raise
    except Exception as exc:  # a guard no re-trace could satisfy, or differently cut traces
        raise PipelineFailed(f"tracing failed: {type(exc).__name__}: {exc}") from exc
    state_log = getattr(lifecycle.state, "guards_retraced", None)
    if isinstance(state_log, list):
        state_log.extend(traces.retraced)
    skipped = traces.traces[0].skipped_targets
    if skipped:  # e.g. a vision tower calibrated on text only
        shown = ", ".join(skipped[:3]) + (", ..." if len(skipped) > 3 else "")
        warn_user(f"sequential: {len(skipped)} target(s) not run by the calibration inputs ({shown}); "
                  f"modifiers get no samples for them")
    return traces, assignment


@dataclass
class Piece:
    """Piece ``index`` of the model: the same targets in every trace, one subgraph per trace."""

    index: int
    subgraphs: list[Any]
    assignment: list[int]

    @property
    def target_names(self) -> list[str]:
        return self.subgraphs[0].target_names

    @property
    def modules(self) -> list[str]:
        return list(dict.fromkeys(m for sub in self.subgraphs for m in sub.modules))

    @property
    def input_names(self) -> list[str]:
        return list(dict.fromkeys(n for sub in self.subgraphs for n in sub.input_names))

    @property
    def consumed_names(self) -> list[str]:
        return list(dict.fromkeys(n for sub in self.subgraphs for n in sub.consumed_names))

    def run(self, batch: int, cache: IntermediatesCache) -> dict[str, Any]:
        """This piece's outputs for one batch, through the subgraph of that batch's trace."""
        sub = self.subgraphs[self.assignment[batch]]
        return sub.run(cache.fetch(batch, sub.input_names))


class SequentialPipeline(Pipeline):
    name = "sequential"

    def run(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], lifecycle: Lifecycle,
            options: PipelineOptions) -> None:
        if not batches:
            raise PipelineFailed("sequential needs at least one calibration batch")
        device = execution_device(model, lifecycle, options)
        with calibration_mode(model, lifecycle):
            traces, assignment = traces_for_batches(model, batches, options, lifecycle)
            subgraphs = [Piece(k, [t.subgraphs[k] for t in traces.traces], assignment)
                         for k in range(len(traces.traces[0].subgraphs))]
            targets = [t for sub in subgraphs for t in sub.target_names]
            offloader = ModuleOffloader(model, device, protected=targets)
            cache = IntermediatesCache(options.offload, execution_device=device, offload_dir=options.offload_dir)
            try:
                wanted = set().union(*(s.input_names for s in subgraphs))
                for index, batch in enumerate(batches):
                    cache.update(index, {k: v for k, v in batch.items() if k in wanted})
                with lifecycle.calibrating():
                    self._calibrate(subgraphs, offloader, cache, lifecycle, options, len(batches))
            finally:
                cache.close()

    def _calibrate(self, subgraphs: list[Piece], offloader: ModuleOffloader, cache: IntermediatesCache,
                   lifecycle: Lifecycle, options: PipelineOptions, num_batches: int) -> None:
        last = len(subgraphs) - 1
        compressed = False
        tail = list(subgraphs[last].modules)
        tail_inputs = lifecycle.calibration_inputs(tail)
        tail_runs = tail_inputs is None or bool(tail_inputs)
        dropped: set[int] = set()  # batches whose activations became non-finite
        for position, sub in enumerate(progress(subgraphs, "calibrating subgraphs", options.show_progress)):
            # the tail's outputs are never used: it runs only when a modifier reads data in it (an LLM's
            # lm_head, usually ignored, costs more than a decoder layer), and so does what feeds it
            feeds_next = position + 1 < last or (position + 1 == last and tail_runs)
            keep = feeds_next and not options.propagate_error
            run = position < last or tail_runs
            with offloader.onloaded(sub.modules):
                # outputs not kept: the forward may end once every input the modifiers read was seen
                stop = None if keep or not run else _EarlyStop.for_piece(offloader.model, sub, lifecycle)
                try:
                    for i in range(num_batches if run else 0):
                        if i in dropped:
                            continue
                        try:
                            with stop.batch() if stop is not None else contextlib.nullcontext():
                                outputs = sub.run(i, cache)
                        except _StopPiece:
                            continue
                        except FATAL_ERRORS:
                            raise
                        except Exception as exc:
                            if compressed:
                                raise
                            # nothing compressed yet: another pipeline can still take over
                            raise PipelineFailed(f"{_where(sub)} failed to run: {type(exc).__name__}: {exc}") from exc
                        if keep and not drop_if_non_finite(i, outputs, _where(sub), dropped, num_batches):
                            cache.update(i, outputs)
                finally:
                    if stop is not None:
                        stop.close()
                lifecycle.sequential_epoch_end(list(sub.modules))
                compressed = True
                if feeds_next and options.propagate_error:  # re-run with the compressed weights
                    with calibration_hooks_paused(lifecycle):
                        for i in range(num_batches):
                            if i in dropped:
                                continue
                            outputs = sub.run(i, cache)
                            if not drop_if_non_finite(i, outputs, _where(sub), dropped, num_batches):
                                cache.update(i, outputs)
            cache.free(sub.consumed_names)


def _where(sub: Piece) -> str:
    return f"subgraph {sub.index} ({', '.join(sub.target_names) or 'head'})"


class _StopPiece(BaseException):
    """Ends a calibration forward whose outputs are not used (raised by :class:`_EarlyStop`).

    A BaseException, so that model code catching ``Exception`` cannot swallow it.
    """


class _EarlyStop:
    """Ends a piece's calibration forward once every input the modifiers read has been seen.

    When the outputs of the calibration forward are thrown away (the piece re-runs with
    compressed weights to feed the next one), computing past the last module whose input
    a modifier reads is wasted -- e.g. a decoder layer's ``down_proj`` and residual add.
    The first batch runs in full and records the order the needed modules run in; if
    each ran exactly once, later batches stop at the pre-hook of the last of them --
    after the modifiers' own hooks on it ran -- provided every needed module ran in
    that batch too. Otherwise (a module called twice, one not called) nothing stops.
    """

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.needed = set(modules)
        self.calls: dict[str, int] = {}
        self.last: str | None = None
        self.learning = True
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in modules.items()]

    @classmethod
    def for_piece(cls, model: torch.nn.Module, sub: Any, lifecycle: Lifecycle) -> _EarlyStop | None:
        names = lifecycle.calibration_inputs(list(sub.modules))
        if not names:  # None: a modifier needs the whole forward; empty: nobody reads anything
            return None
        try:
            return cls({n: model.get_submodule(n) for n in sorted(names)})
        except AttributeError:
            return None

    def _hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1
            if (name == self.last and len(self.calls) == len(self.needed)
                    and all(count == 1 for count in self.calls.values())):
                raise _StopPiece
        return hook

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        self.calls = {}
        yield
        if self.learning:  # the first complete forward decides where later ones may stop
            self.learning = False
            if set(self.calls) == self.needed and all(c == 1 for c in self.calls.values()):
                self.last = list(self.calls)[-1]

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
