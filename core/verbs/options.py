"""How a run executes, as frozen option groups checked once, read by every part that needs them.

``compress()`` keeps the everyday arguments (model, recipe, dataset, output folder, sample count
and length, device, overwrite, progress bars); the rest arrive as one :class:`CompressOptions`
made of four groups, each validated when it is made, with the same errors the CLI gives:

- :class:`CalibrationOptions`: what data the modifiers see and where the model is cut;
- :class:`PlacementOptions`: where weights and cached activations rest, and where they compute;
- :class:`OutputOptions`: how the result is written;
- :class:`SafetyOptions`: what a run refuses.

The CLI builds the same object from its flags (:meth:`CompressOptions.of` takes them flat), the
run summary records :meth:`CompressOptions.as_dict`, and the resume fingerprint is
:meth:`CompressOptions.fingerprint`: one source for all three.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from layerwise.errors import (
    InvalidArgumentError,
    check_choice,
    did_you_mean,
    require_positive,
)
from layerwise.host.model_patch import ModelPatch
from layerwise.host.pipeline import check_pieces
from layerwise.model_io.calibration_data import check_packing
from layerwise.model_io.saving import Overwrite, check_overwrite
from layerwise.model_io.streaming.stream import WEIGHTS
from layerwise.runtime.finite import check_mode

#: where cached activations rest between pieces (``auto``: disk when they would not fit in memory)
OFFLOADS = ("auto", "cpu", "disk")
#: where the weights rest: the streaming choices, and ``model-free`` (no model at all: shard by shard)
WEIGHT_CHOICES = (*WEIGHTS, "model-free")
#: how chat rows (``messages``) become text: the tokenizer's chat template when it has one (``auto``; an error
#: when a chat row meets a tokenizer without one), always (``on``: every row must be a chat), never (``off``)
CHAT_TEMPLATES = ("auto", "on", "off")


def _as_tuple(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class CalibrationOptions:
    """What data the modifiers see, and how the model is cut into pieces."""

    #: calibration samples taken from the dataset
    num_calibration_samples: int = 512
    #: tokens per sample; ``None``: 2048, or the model's context length when shorter
    max_seq_length: int | None = None
    #: ``"chunk"`` joins texts into full windows, ``"truncate"`` keeps one sample per text;
    #: ``None``: truncate for tokenizers with a ``[CLS]`` token, else concatenate
    packing: str | None = None
    #: the blocks calibrated one at a time (class names, qualified names or ``re:`` patterns);
    #: ``None``: the model patch's, else found from the model's structure
    sequential_targets: tuple[str, ...] | None = None
    #: modules left uncompressed; ``None``: the model patch's list
    ignore: tuple[str, ...] | None = None
    #: consecutive targets calibrated as one piece (fewer passes, more memory)
    targets_per_subgraph: int = 1
    #: a pipeline by name; ``None``: chosen for the model and recipe, with fall-backs
    pipeline: str | None = None
    #: ``"layers"`` cuts before the layers a modifier reads, ``"blocks"`` after each target, ``"auto"``
    pieces: str = "auto"
    #: feed each piece the compressed model's activations (``False``: the uncompressed model's)
    propagate_error: bool = True
    #: the model patch: ``None``/``True`` picks one, ``False`` none, a name or a ``ModelPatch`` that one
    patch: ModelPatch | str | bool | None = None
    #: the tokenizer for text datasets; ``None``: the model folder's
    tokenizer: Any = field(default=None, compare=False, repr=False)
    #: chat rows (``{"messages": [{"role", "content"}, ...]}``) rendered with the tokenizer's chat template:
    #: ``"auto"`` (chat rows are, text rows stay text), ``"on"`` (every row must be a chat), ``"off"`` (the
    #: messages' contents joined as plain text)
    chat_template: str = "auto"

    def __post_init__(self) -> None:
        require_positive(self.num_calibration_samples, "num_calibration_samples", "--num-samples")
        if self.max_seq_length is not None:
            require_positive(self.max_seq_length, "max_seq_length", "--max-seq-length")
        require_positive(self.targets_per_subgraph, "targets_per_subgraph", "--targets-per-subgraph")
        check_pieces(self.pieces)
        check_packing(self.packing)
        check_choice(self.chat_template, CHAT_TEMPLATES, "chat_template", "--chat-template")
        object.__setattr__(self, "sequential_targets", _as_tuple(self.sequential_targets))
        object.__setattr__(self, "ignore", _as_tuple(self.ignore))


@dataclass(frozen=True)
class PlacementOptions:
    """Where the run's tensors rest and where they compute."""

    #: ``"cpu"``, ``"cuda"``, ``"cuda:N"``; ``None``: the first GPU torch sees, else the CPU
    device: str | None = None
    #: ``"memory"`` loads the model whole, ``"stream"`` reads each piece from the model folder and
    #: writes it to the output when done, ``"auto"`` streams when the model would not fit in memory;
    #: ``"model-free"`` builds no model: a data-free recipe quantizes the safetensors shard by shard
    weights: str = "auto"
    #: where cached activations rest between pieces: ``"cpu"``, ``"disk"`` or ``"auto"``
    offload: str = "auto"
    #: ``weights="model-free"``: shards quantized at once (``None``: as many as shards, cores and memory allow)
    workers: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.device, torch.device):
            object.__setattr__(self, "device", str(self.device))
        check_choice(self.weights, WEIGHT_CHOICES, "weights", "--weights")
        if self.workers is not None:
            require_positive(self.workers, "workers", "--workers")
        check_choice(self.offload, OFFLOADS, "offload", "--offload")


@dataclass(frozen=True)
class OutputOptions:
    """How the result is written."""

    #: a registered saver (``layerwise plugins`` lists them)
    save_format: str = "compressed-tensors"
    #: ``True`` replaces a folder layerwise wrote, ``"any"`` any folder (never one holding an input)
    overwrite: Overwrite = False
    #: continue an interrupted run on the same output folder after its last finished piece
    resume: bool = False

    def __post_init__(self) -> None:
        check_overwrite(self.overwrite)


@dataclass(frozen=True)
class SafetyOptions:
    """What a run refuses."""

    #: ``"error"``: a NaN/inf parameter stops the run before calibration; ``"skip"``: leave those modules
    non_finite: str = "error"
    #: let transformers run Python shipped with the model (its config's ``auto_map``)
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        check_mode(self.non_finite)


GROUPS = {"calibration": CalibrationOptions, "placement": PlacementOptions, "output": OutputOptions,
          "safety": SafetyOptions}


@dataclass(frozen=True)
class CompressOptions:
    """Every setting of a run but the everyday ones, in four frozen groups."""

    calibration: CalibrationOptions = field(default_factory=CalibrationOptions)
    placement: PlacementOptions = field(default_factory=PlacementOptions)
    output: OutputOptions = field(default_factory=OutputOptions)
    safety: SafetyOptions = field(default_factory=SafetyOptions)

    @classmethod
    def of(cls, **settings: Any) -> CompressOptions:
        """Options from flat keywords, each routed to its group: ``CompressOptions.of(pieces="layers")``."""
        return cls().replace(**settings)

    def replace(self, **settings: Any) -> CompressOptions:
        """A copy with the given flat settings changed (each validated by its group)."""
        changes: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            changes.setdefault(group_of(name), {})[name] = value
        return dataclasses.replace(self, **{group: dataclasses.replace(getattr(self, group), **fields)
                                            for group, fields in changes.items()})

    def as_dict(self) -> dict[str, Any]:
        """Every setting by name, JSON-ready (a patch by its name, no tokenizer): what the summary records."""
        flat: dict[str, Any] = {}
        for group in GROUPS:
            for item in dataclasses.fields(getattr(self, group)):
                if item.compare:
                    flat[item.name] = _plain(getattr(getattr(self, group), item.name))
        return flat

    def fingerprint(self) -> dict[str, Any]:
        """The settings a resumed run must share with the interrupted one (they change what is computed)."""
        calibration = self.calibration
        return {"pieces": calibration.pieces, "propagate_error": calibration.propagate_error,
                "targets_per_subgraph": calibration.targets_per_subgraph, "save_format": self.output.save_format,
                "non_finite": self.safety.non_finite}


def group_of(name: str) -> str:
    """The group holding setting ``name``; an unknown name lists the valid ones."""
    for group, cls in GROUPS.items():
        if name in {item.name for item in dataclasses.fields(cls)}:
            return group
    valid = sorted(setting_names())
    raise InvalidArgumentError(f"unknown compress option {name!r};{did_you_mean(name, valid)} options: "
                               f"{', '.join(valid)}")


def setting_names() -> list[str]:
    """Every flat setting name :meth:`CompressOptions.of` takes."""
    return [item.name for cls in GROUPS.values() for item in dataclasses.fields(cls)]


def _plain(value: Any) -> Any:
    if isinstance(value, ModelPatch):
        return value.name
    if isinstance(value, tuple):
        return list(value)
    return value


def with_everyday(options: CompressOptions, num_calibration_samples: int | None, max_seq_length: int | None,
                  device: str | torch.device | None, overwrite: Overwrite | None) -> CompressOptions:
    """``options`` with the everyday arguments that were given (``None``: not given) put in their groups
    (``compress()`` and ``plan()`` take them the same way)."""
    if not isinstance(options, CompressOptions):
        raise InvalidArgumentError(f"options must be a CompressOptions, not {type(options).__name__}: "
                                   f"CompressOptions.of(pieces='layers', ...)")
    given = {"num_calibration_samples": num_calibration_samples, "max_seq_length": max_seq_length,
             "device": device, "overwrite": overwrite}
    return options.replace(**{name: value for name, value in given.items() if value is not None})
