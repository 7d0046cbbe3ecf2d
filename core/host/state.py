"""What one compression run knows: the model, its patch, targets, and the run's log."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from layerwise.host.model_patch import ModelPatch
from layerwise.host.patch_selection import applied_patch
from layerwise.runtime.accounting import Accounting

T = TypeVar("T")


@dataclass
class CompressionState:
    """Shared by the pipeline and the modifiers during one ``compress()`` call."""

    model: torch.nn.Module
    modifiers: list[Any]
    patch: ModelPatch | None = None
    sequential_targets: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    #: where calibration runs (cuda when there is one); weights rest on their offload device
    execution_device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    #: free-form per-layer records modifiers write (loss, time, ...); saved with the model
    log: list[dict[str, Any]] = field(default_factory=list)
    #: trace guards some batch broke, each forcing a trace of its own (see layerwise.tracing.retrace)
    guards_retraced: list[str] = field(default_factory=list)
    #: how the pipeline cut the model and why (``layers: 43 pieces, each run once per batch``)
    pieces: str = ""
    #: what rested on the execution device and why (:class:`layerwise.runtime.placement.Placement`'s reason)
    placement: str = ""
    #: the most bytes of cached activations held in memory at once (both streams; 0: no cache)
    cache_peak: int = 0
    #: seconds (and FLOPs where counted) per phase: pipelines' forwards, modifiers' own work
    accounting: Accounting = field(default_factory=Accounting)
    #: the calibration batches, for a modifier that needs a whole-model statistics pass first (OWL)
    batches: list[Any] = field(default_factory=list)
    #: what a plugin's modifiers share in one run (the Hessian modifiers' Gram matrices, ...), keyed by
    #: the plugin's own type; core never looks inside: see :meth:`shared`
    extensions: dict[type, Any] = field(default_factory=dict)

    @property
    def model_patch(self) -> ModelPatch | None:
        """The run's patch, else the one applied to the model (a modifier run on a state built without it)."""
        return self.patch or applied_patch(self.model)

    def shared(self, kind: type[T], create: Callable[[], T]) -> T:
        """The run's one ``kind`` object: made by ``create`` for the first modifier that asks, then shared."""
        if kind not in self.extensions:
            self.extensions[kind] = create()
        return self.extensions[kind]
