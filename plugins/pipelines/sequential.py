"""``sequential``: the traced subgraphs, one after another, with cached intermediates.

The model is traced (the first batch gives the sample shapes) into one subgraph per
sequential target plus the rest. Every batch flows through subgraph 1, its outputs
go to the intermediates cache, the subgraph's modules are compressed, the subgraph
re-runs with the compressed weights (``propagate_error``) to produce the next
subgraph's inputs, values are freed after their last consumer, and so on.

Tracing happens before any modifier sees data: a model that cannot be traced fails
with :class:`~layerwise.pipeline.PipelineFailed` and nothing was changed.
"""

from __future__ import annotations

import warnings

from collections.abc import Sequence
from typing import Any

import torch

from layerwise.cache import IntermediatesCache
from layerwise.lifecycle import Lifecycle
from layerwise.offload import ModuleOffloader
from layerwise.pipeline import Pipeline, PipelineFailed, PipelineOptions

from ._common import FATAL_ERRORS, calibration_hooks_paused, calibration_mode, execution_device, progress


def trace_for_pipeline(model: torch.nn.Module, sample: dict[str, Any], options: PipelineOptions,
                       lifecycle: Lifecycle) -> Any:
    """The model's subgraphs; any tracing error becomes :class:`PipelineFailed`."""
    try:
        from layerwise.tracing import trace
    except ImportError as exc:  # pragma: no cover - the tracer ships with layerwise
        raise PipelineFailed(f"the tracer is not available: {exc}") from exc
    patch = getattr(lifecycle.state, "patch", None)
    extra: dict[str, Any] = {}
    if patch is not None:
        extra = {"opaque_functions": tuple(patch.opaque_functions), "leaf_modules": tuple(patch.leaf_modules)}
    try:
        result = trace(model, sample, sequential_targets=options.sequential_targets or None,
                       ignore=options.ignore or None, targets_per_subgraph=options.targets_per_subgraph,
                       skip_uncalled_targets=True, **extra)
    except FATAL_ERRORS:
        raise
    except Exception as exc:  # noqa: BLE001 - any tracing failure means "try another pipeline"
        raise PipelineFailed(f"tracing failed: {type(exc).__name__}: {exc}") from exc
    for note in result.notes:
        if "not run by these inputs" in note:
            # e.g. a vision tower calibrated on text only: its modules see no samples
            warnings.warn(f"sequential: {note}; modifiers get no samples for them", stacklevel=2)
    return result


class SequentialPipeline(Pipeline):
    name = "sequential"

    def run(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], lifecycle: Lifecycle,
            options: PipelineOptions) -> None:
        if not batches:
            raise PipelineFailed("sequential needs at least one calibration batch")
        device = execution_device(model, lifecycle, options)
        with calibration_mode(model, lifecycle):
            result = trace_for_pipeline(model, dict(batches[0]), options, lifecycle)
            subgraphs = list(result.subgraphs)
            targets = [t for sub in subgraphs for t in sub.target_names]
            offloader = ModuleOffloader(model, device, protected=targets)
            cache = IntermediatesCache(options.offload, execution_device=device, offload_dir=options.offload_dir)
            try:
                wanted = set(subgraphs[0].input_names).union(*(s.input_names for s in subgraphs))
                for index, batch in enumerate(batches):
                    cache.update(index, {k: v for k, v in batch.items() if k in wanted})
                with lifecycle.calibrating():
                    self._calibrate(subgraphs, offloader, cache, lifecycle, options, len(batches))
            finally:
                cache.close()

    def _calibrate(self, subgraphs: list[Any], offloader: ModuleOffloader, cache: IntermediatesCache,
                   lifecycle: Lifecycle, options: PipelineOptions, num_batches: int) -> None:
        last = len(subgraphs) - 1
        compressed = False
        tail = list(subgraphs[last].modules)
        for position, sub in enumerate(progress(subgraphs, "calibrating subgraphs", options.show_progress)):
            # the tail's outputs are never used: it runs only when a modifier needs its data (an LLM's
            # lm_head, usually ignored, costs more than a decoder layer), and so does what feeds it
            feeds_next = position + 1 < last or (position + 1 == last and lifecycle.needs_data(tail))
            keep = feeds_next and not options.propagate_error
            run = position < last or lifecycle.needs_data(tail)
            with offloader.onloaded(sub.modules):
                for i in range(num_batches if run else 0):
                    try:
                        outputs = sub.run(cache.fetch(i, sub.input_names))
                    except FATAL_ERRORS:
                        raise
                    except Exception as exc:
                        if compressed:
                            raise
                        # nothing compressed yet: another pipeline can still take over
                        raise PipelineFailed(f"subgraph {sub.index} ({', '.join(sub.target_names) or 'head'}) "
                                             f"failed to run: {type(exc).__name__}: {exc}") from exc
                    if keep:
                        cache.update(i, outputs)
                lifecycle.sequential_epoch_end(list(sub.modules))
                compressed = True
                if feeds_next and options.propagate_error:  # re-run with the compressed weights
                    with calibration_hooks_paused(lifecycle):
                        for i in range(num_batches):
                            cache.update(i, sub.run(cache.fetch(i, sub.input_names)))
            cache.free(sub.consumed_names)
