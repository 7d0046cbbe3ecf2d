"""``datafree``: no calibration data; one compression step for every module.

With weights streamed from disk (``options.stream``) the step is taken one sequential target at
a time, then for the modules outside every target, so only one target's weights are loaded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch

from layerwise.plugin import Lifecycle
from layerwise.plugin.pipelines import ModuleOffloader, Pipeline, PipelineOptions

from ._common import all_module_names, calibration_mode, execution_device, resolve_targets

#: the accounting phase of the modifiers' work (with streamed weights, reading each target's weights too)
STEP_PHASE = "data-free step"


class DataFreePipeline(Pipeline):
    name = "datafree"
    runs_data = False
    streams_weights = True

    def run(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], lifecycle: Lifecycle,
            options: PipelineOptions) -> None:
        # batches, if any were given, are not needed: data-free modifiers look only at weights
        accounting = getattr(lifecycle.state, "accounting", None)
        timed = accounting.timed(STEP_PHASE) if accounting is not None else contextlib.nullcontext()
        with calibration_mode(model, lifecycle), lifecycle.calibrating(), timed:
            if options.stream is None:
                lifecycle.sequential_epoch_end(all_module_names(model))
                return
            targets = resolve_targets(model, options.sequential_targets, options.ignore)
            offloader = ModuleOffloader(model, execution_device(model, lifecycle, options), protected=targets,
                                        source=options.stream)
            for target in targets:
                with offloader.onloaded([target]):
                    lifecycle.sequential_epoch_end([target])
                    offloader.retire([target])
            for name in options.stream.leftovers():
                with offloader.onloaded([name]):
                    lifecycle.sequential_epoch_end([name])
                    offloader.retire([name])
