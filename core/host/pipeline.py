"""The calibration-pipeline interface; the built-in pipelines are plugins.

A pipeline moves calibration batches through the model and fires lifecycle
events; it decides *how* data flows (whole model, block by block, traced
subgraphs), never *what* is compressed.
"""

from __future__ import annotations

import contextlib
import contextvars
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from layerwise.errors import LayerwiseError
from layerwise.host.lifecycle import Lifecycle


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
    #: weights streamed from disk (:class:`~layerwise.model_io.streaming.WeightStream`), ``None``: in memory
    stream: Any = None
    #: saves the run after every piece and restores an interrupted one (:class:`~layerwise.model_io.resume.PieceCheckpoint`)
    checkpoint: Any = None


#: ``layers``: cut before each group of layers a modifier reads, every piece runs once per sample;
#: ``blocks``: cut after each sequential target, a block runs observed then compressed;
#: ``auto``: layers where exact (the model traces that finely, modifiers read layer inputs only)
PIECES = ("auto", "layers", "blocks")


def check_pieces(pieces: str) -> None:
    """Refuse an unknown ``pieces`` value before anything loads."""
    from layerwise.errors import check_choice

    check_choice(pieces, PIECES, "pieces", "--pieces")


def blocks_reason(pieces: str, propagate_error: bool, targets_per_subgraph: int, modifiers: Sequence[Any]) -> str:
    """Why ``sequential`` cuts at blocks whatever the model traces, from the options and the recipe alone (``""``:
    the layer cut may be tried). The run's cut and the plan's forecast of it both read this rule."""
    from layerwise.host.modifier import Modifier

    if pieces == "blocks":
        return "asked for (pieces='blocks')"
    if not propagate_error:
        return "propagate_error=False: each block runs once, on the uncompressed model's activations"
    if targets_per_subgraph > 1:
        return f"targets_per_subgraph={targets_per_subgraph} groups blocks"
    return "; ".join(f"{type(m).__name__} {getattr(m, 'block_reason', Modifier.block_reason)}"
                     for m in modifiers if getattr(m, "needs_uncompressed_block", False))


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


_INPUTS_HELD = contextvars.ContextVar("layerwise_inputs_held", default=False)


@contextlib.contextmanager
def inputs_held_unchanged() -> Iterator[None]:
    """Layers called inside see inputs the pipeline holds unchanged until their modifiers compressed them.

    ``sequential`` at layers shows each piece's entry layers their cached inputs (no forward runs
    until ``sequential_epoch_end`` is over), so a hook may keep a reference to an input instead of a
    copy (the Hessian hooks keep inputs until enough rows are waiting for one large product).
    """
    token = _INPUTS_HELD.set(True)
    try:
        yield
    finally:
        _INPUTS_HELD.reset(token)


def inputs_are_held() -> bool:
    """Inside :func:`inputs_held_unchanged`: an input seen now stays as it is until compression."""
    return _INPUTS_HELD.get()


class PipelineFailed(LayerwiseError, RuntimeError):
    """A pipeline could not handle this model (e.g. untraceable); the next one may."""
