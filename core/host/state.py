"""What one compression run knows: the model, its patch, targets, and the run's log."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from layerwise.host.model_patch import ModelPatch
from layerwise.runtime.accounting import Accounting


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
    #: seconds (and FLOPs where counted) per phase: pipelines' forwards, modifiers' own work
    accounting: Accounting = field(default_factory=Accounting)
    #: the calibration batches, for a modifier that needs a whole-model statistics pass first (OWL)
    batches: list[Any] = field(default_factory=list)
    #: the input Gram matrices Hessian-based modifiers share (SparseGPT then GPTQ: one per layer);
    #: created by the first of them at calibration start (layerwise.plugins.modifiers.hessians)
    hessian_bank: Any = None
