"""``independent``: every modifier gets its own calibration run.

Each modifier is driven through calibration_start ... calibration_end on its own,
with the pipeline the default choice gives it (``datafree`` for a data-free one,
else ``sequential`` -> ``layer_sequential`` -> ``basic``, with the usual fallback
warnings), so a later modifier calibrates on the model the earlier ones compressed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from layerwise.plugin import Lifecycle
from layerwise.plugin.pipelines import Pipeline, PipelineFailed, PipelineOptions


class IndependentPipeline(Pipeline):
    name = "independent"

    def run(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], lifecycle: Lifecycle,
            options: PipelineOptions) -> None:
        from layerwise.plugin.pipelines import PipelineAborted, run_pipeline

        done: list[str] = []
        for modifier in list(lifecycle.modifiers):
            own = Lifecycle(lifecycle.state)
            own.modifiers = [modifier]
            try:
                used = run_pipeline(model, batches, own, options, exclude=(self.name,))
            except PipelineFailed as exc:
                if done:  # earlier modifiers already changed the weights: no other pipeline may take over
                    raise PipelineAborted(f"independent: {type(modifier).__name__} failed ({exc}) after "
                                          f"{', '.join(done)} compressed the model") from exc
                raise
            done.append(f"{type(modifier).__name__} via {used}")
