"""The Modifier base class: a compression algorithm that reacts to lifecycle events.

A modifier implements only the events it needs; pipelines fire them, modifiers
never drive the pipeline. Hooks registered through :meth:`Modifier.register_hook`
are removed by the lifecycle on every path out, errors included.

Modifiers are dataclasses, so a recipe's fields map one to one onto constructor
arguments and an unknown field is an error that lists the valid ones, in a recipe and in a
Python call alike (:mod:`layerwise.host.modifier_fields`).

In a distributed run (several ranks, each calibrating on its share of the batches, see
:mod:`layerwise.runtime.distributed`) a modifier that gathers statistics from data merges them over the
ranks in :meth:`Modifier.on_reduce`, fired before each piece is compressed; the built-in ones
also spread their per-layer solves over the ranks with :func:`layerwise.runtime.distributed.spread`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from layerwise.host.modifier_fields import ReadsRecipeFields

if TYPE_CHECKING:
    from layerwise.host.state import CompressionState
    from layerwise.runtime.distributed import Reducer


@dataclasses.dataclass(frozen=True)
class ForeignField:
    """A field another tool's recipes give a modifier (llm-compressor's ``sequential_update``, ...).

    ``ignored``: read and dropped with a warning carrying ``note`` (why nothing is lost); else refused,
    the error carrying ``note`` (layerwise's equivalent). ``rename``: the modifier's own field that takes
    the value as written (the same setting under another name: no warning; giving both is an error).
    ``layerwise_values``: the values that ask for what layerwise does anyway (``bypass_divisibility_checks:
    false``, which llm-compressor writes into every recipe it saves): dropped without a word.
    """

    note: str
    ignored: bool = True
    rename: str | None = None
    layerwise_values: tuple[Any, ...] = ()


#: what llm-compressor's modifiers all take for its training sessions; one-shot runs have no schedule
SESSION_FIELDS = {name: ForeignField("a field of llm-compressor's training schedule; layerwise runs one-shot "
                                     "compression, so there is no schedule to place the modifier in")
                  for name in ("start", "end", "update", "index", "group")}


@dataclasses.dataclass
class Modifier(metaclass=ReadsRecipeFields):
    """Base of every modifier. Subclasses are dataclasses with their own fields."""

    #: does the modifier need calibration data? (``False`` picks the ``datafree`` pipeline)
    requires_data: ClassVar[bool] = True
    #: must the layers of a block be observed on the block's inputs *before* any of its layers is
    #: compressed? (Wanda: it compensates nothing, so a layer scored on a pruned neighbour's
    #: outputs only adds error.) ``True`` makes the ``sequential`` pipeline cut at blocks.
    needs_uncompressed_block: ClassVar[bool] = False
    #: why it needs that, as the run's ``pieces`` line gives the reason for the blocks cut ("<class> <reason>")
    block_reason: ClassVar[str] = "observes each block before compressing any of its layers"
    #: does it read its layers' inputs in the *uncompressed* model as well (GPTAQ)? The ``sequential``
    #: pipeline then carries a second stream of activations through the original weights and runs each
    #: batch through it, with :meth:`reference_hooks` on (the other hooks paused), just before the
    #: observed run of that batch. Needs the blocks cut (``needs_uncompressed_block``).
    needs_reference_inputs: ClassVar[bool] = False
    #: calibration samples below which its statistics are poor (a warning says so); 0: no minimum
    min_calibration_samples: ClassVar[int] = 0
    #: recipe presets ``<prefix>_<SCHEME>`` build this modifier with that scheme (``"GPTQ"``: ``GPTQ_W4A16``);
    #: read from the class that declares it, not inherited by subclasses
    preset_prefix: ClassVar[str | None] = None
    #: presets that chain registered modifiers in one run: name -> ((modifier name, fields), ...)
    chained_presets: ClassVar[dict[str, tuple[tuple[str, dict[str, Any]], ...]]] = {}
    #: fields of other tools' recipes (llm-compressor's) this modifier reads: ignored with a warning saying why,
    #: or refused naming layerwise's equivalent (:class:`ForeignField`)
    foreign_fields: ClassVar[dict[str, ForeignField]] = {}
    #: how many llm-compressor ``config_groups`` a recipe may give (each becomes one instance with that scheme
    #: and targets; the modifier needs ``scheme``, ``targets`` and ``ignore`` fields); ``None``: any number
    max_config_groups: ClassVar[int | None] = 0

    def __post_init__(self) -> None:
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []

    # -- events (override what you need) -------------------------------------
    def on_initialize(self, state: CompressionState) -> None:
        """Resolve targets, attach schemes; called once before any data flows."""

    def on_calibration_start(self, state: CompressionState) -> None:
        """Register observers / Hessian hooks before the first batch."""

    def on_reduce(self, state: CompressionState, reducer: Reducer, modules: list[str] | None) -> None:
        """Merge the statistics gathered for ``modules`` over the ranks of a distributed run.

        Fired only with several ranks, on every rank, right before ``sequential_epoch_end(modules)``
        and (``modules=None``: everything not compressed yet) before ``calibration_end``. Each rank
        calibrated on its own share of the batches; afterwards every rank must hold what a single
        process calibrating on all of them would: sums summed (``reducer.sum(tensor)``, in place),
        maxima maxed, minima minned, counts counted (``reducer.count(n)``), anything else gathered
        (``reducer.gather(obj)``). Every rank must make the same calls in the same order with tensors
        of the same shapes (a rank that saw no data contributes zeros / ``-inf`` / ``inf``). The
        compressing events that follow then run identically on every rank. Default: nothing (a
        modifier that gathers no statistics).
        """

    def on_sequential_epoch_end(self, state: CompressionState, modules: list[str]) -> None:
        """Compress the given modules (qualified names) of the subgraph just calibrated."""

    def on_calibration_end(self, state: CompressionState) -> None:
        """Compress what is left; calibration hooks are removed right after this."""

    def on_finalize(self, state: CompressionState) -> None:
        """Last chance to tidy the model before saving."""

    def calibration_inputs(self, modules: list[str]) -> set[str] | None:
        """Which modules' inputs this modifier reads while calibration data runs through ``modules``.

        ``modules`` are the qualified names of one piece of the model. Return the names
        (among them) whose *inputs* the modifier's forward **pre**-hooks read, or ``None``
        when it needs the whole forward (outputs, other activations). Pipelines use the
        answer to skip a piece nobody reads from, to end a forward whose outputs are not used
        as soon as every needed input was seen, and (``sequential`` at layers) to cut the
        model before those modules: their pre-hooks are then called with cached inputs and
        their forward is skipped, so a modifier answering with names must read nothing but
        what its pre-hooks receive. Default: ``None`` for a modifier that requires data,
        else none.
        """
        return None if self.requires_data else set()

    # -- hooks -------------------------------------------------------------------
    def register_hook(self, module: torch.nn.Module, fn: Callable[..., Any], kind: str = "forward",
                      **kwargs: Any) -> torch.utils.hooks.RemovableHandle:
        """Register a ``forward`` / ``forward_pre`` hook that the lifecycle removes for you."""
        register = {"forward": module.register_forward_hook,
                    "forward_pre": module.register_forward_pre_hook}[kind]
        handle = register(fn, **kwargs)
        self._hooks.append(handle)
        return handle

    def remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    def reference_hooks(self, modules: list[str]) -> list[torch.utils.hooks.RemovableHandle]:
        """Hooks on the layers of ``modules`` that see one batch's inputs in the uncompressed model (only
        called when :attr:`needs_reference_inputs`); the pipeline removes them after that batch."""
        return []

    # -- output --------------------------------------------------------------------------
    def output_files(self) -> dict[str, str | bytes]:
        """Extra files to save next to the compressed model: name (relative to the folder) -> content."""
        return {}

    # -- recipe round trip -------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The modifier's fields as a recipe entry (``{ClassName: {field: value}}``)."""
        fields = {}
        for f in dataclasses.fields(self):
            if not f.name.startswith("_"):
                fields[f.name] = _plain(getattr(self, f.name))
        return {type(self).__name__: fields}


def _plain(value: Any) -> Any:
    from layerwise.algorithms.quantization.config_groups import plain

    value = plain(value)  # compressed-tensors' QuantizationArgs / QuantizationScheme: the mapping it saves as
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
