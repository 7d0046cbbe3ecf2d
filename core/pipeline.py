"""The calibration-pipeline interface; the built-in pipelines are plugins.

A pipeline moves calibration batches through the model and fires lifecycle
events; it decides *how* data flows (whole model, block by block, traced
subgraphs), never *what* is compressed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from .errors import LayerwiseError
from .lifecycle import Lifecycle


@dataclass
class PipelineOptions:
    """Knobs every pipeline understands (a pipeline ignores those it has no use for)."""

    sequential_targets: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    #: re-run each compressed subgraph to feed the next one its compressed-model inputs
    propagate_error: bool = True
    #: where ``sequential`` cuts: ``"layers"``, ``"blocks"`` or ``"auto"`` (see :data:`PIECES`)
    pieces: str = "auto"
    #: where cached intermediates rest: "cpu" or "disk"
    offload: str = "cpu"
    offload_dir: str | None = None
    targets_per_subgraph: int = 1
    execution_device: torch.device | None = None
    show_progress: bool = True
    #: weights streamed from disk (:class:`~layerwise.streaming.WeightStream`), ``None``: in memory
    stream: Any = None
    #: saves the run after every piece and restores an interrupted one (:class:`~layerwise.resume.PieceCheckpoint`)
    checkpoint: Any = None


#: ``layers``: cut before each group of layers a modifier reads, every piece runs once per sample;
#: ``blocks``: cut after each sequential target, a block runs observed then compressed;
#: ``auto``: layers where exact (the model traces that finely, modifiers read layer inputs only)
PIECES = ("auto", "layers", "blocks")


def check_pieces(pieces: str) -> None:
    """Refuse an unknown ``pieces`` value before anything loads."""
    from .errors import check_choice

    check_choice(pieces, PIECES, "pieces", "--pieces")


class Pipeline(ABC):
    """Runs calibration data through a model, firing lifecycle events."""

    name: ClassVar[str]
    #: False for a pipeline that never runs calibration data (``datafree``): the plugin kit then
    #: checks its events only, not that every sample reached every layer
    runs_data: ClassVar[bool] = True
    #: True for a pipeline that onloads every piece through ``options.stream`` and retires each piece's
    #: modules once no later piece runs them (weights streamed from disk); only these run streamed
    streams_weights: ClassVar[bool] = False

    @abstractmethod
    def run(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], lifecycle: Lifecycle,
            options: PipelineOptions) -> None:
        """Calibrate: fire ``calibration_start``, ``sequential_epoch_end`` per piece, ``calibration_end``."""


class PipelineFailed(LayerwiseError, RuntimeError):
    """A pipeline could not handle this model (e.g. untraceable); the next one may."""
