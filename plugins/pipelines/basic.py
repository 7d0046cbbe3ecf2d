"""``basic``: the whole model per batch, then one compression step for every module.

Needs the whole model on the execution device; works for any model that runs.
Equivalent to the layer-by-layer pipelines with error propagation off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from layerwise.plugin import Lifecycle
from layerwise.plugin.pipelines import ModuleOffloader, Pipeline, PipelineOptions

from ._common import all_module_names, calibration_mode, execution_device, forward_kwargs, progress


class BasicPipeline(Pipeline):
    name = "basic"

    def run(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], lifecycle: Lifecycle,
            options: PipelineOptions) -> None:
        device = execution_device(model, lifecycle, options)
        offloader = ModuleOffloader(model, device)
        with calibration_mode(model, lifecycle), offloader.onloaded([""]), lifecycle.calibrating():
            for batch in progress(batches, "calibrating (whole model)", options.show_progress):
                model(**forward_kwargs(model, batch, device))
            lifecycle.sequential_epoch_end(all_module_names(model))
