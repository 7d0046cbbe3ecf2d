"""``datafree``: no calibration data; one compression step for every module."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from layerwise.lifecycle import Lifecycle
from layerwise.pipeline import Pipeline, PipelineOptions

from ._common import all_module_names, calibration_mode


class DataFreePipeline(Pipeline):
    name = "datafree"
    runs_data = False

    def run(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], lifecycle: Lifecycle,
            options: PipelineOptions) -> None:
        # batches, if any were given, are not needed: data-free modifiers look only at weights
        with calibration_mode(model, lifecycle), lifecycle.calibrating():
            lifecycle.sequential_epoch_end(all_module_names(model))
