"""Quantization settings as frozen dataclasses: what to quantize and how.

:class:`QuantizationArgs` describes one tensor's quantization (bits, symmetry,
granularity); :class:`QuantizationScheme` pairs weight args with the module
targets they apply to. Both validate on construction and name the valid values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import RecipeError

STRATEGIES = ("tensor", "channel", "group")
BITS = (4, 8)
ACTORDERS = (None, "static", "group")


@dataclass(frozen=True)
class QuantizationArgs:
    """How one tensor (a weight) is quantized.

    * ``num_bits``: 4 or 8 (signed integers: int4 is -8..7, int8 is -128..127);
    * ``symmetric``: zero point fixed at 0 (``True``) or fitted to the range;
    * ``strategy``: one scale for the whole ``"tensor"``, one per output ``"channel"``,
      or one per ``group_size`` consecutive input columns of each row (``"group"``);
    * ``observer``: name of a registered observer that measures the range;
    * ``actorder``: GPTQ activation ordering (``None``, ``"static"``, ``"group"``).
    """

    num_bits: int = 4
    symmetric: bool = True
    strategy: str = "group"
    group_size: int | None = 128
    observer: str = "minmax"
    actorder: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.num_bits, bool) or self.num_bits not in BITS:
            raise RecipeError(f"num_bits={self.num_bits!r} is not supported; valid num_bits: 4, 8")
        if not isinstance(self.symmetric, bool):
            raise RecipeError(f"symmetric must be true or false, got {self.symmetric!r}")
        if self.strategy not in STRATEGIES:
            raise RecipeError(f"unknown strategy {self.strategy!r}; valid strategies: {', '.join(STRATEGIES)}")
        if self.strategy == "group" and (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                                         or self.group_size <= 0):
            raise RecipeError(f"strategy 'group' needs a positive integer group_size, got {self.group_size!r} "
                              f"(or use strategy 'channel')")
        if self.actorder not in ACTORDERS:
            raise RecipeError(f"unknown actorder {self.actorder!r}; valid actorders: None, static, group")
        if self.actorder == "group" and self.strategy != "group":
            raise RecipeError("actorder 'group' needs strategy 'group'")
        if not isinstance(self.observer, str) or not self.observer:
            raise RecipeError(f"observer must be a registered observer name, got {self.observer!r}")

    @property
    def effective_group_size(self) -> int | None:
        """``group_size`` when the strategy is ``"group"``, else ``None``."""
        return self.group_size if self.strategy == "group" else None

    def replace(self, **changes: Any) -> QuantizationArgs:
        """A copy with some fields changed (validated again)."""
        if changes.get("strategy") in ("tensor", "channel") and "group_size" not in changes:
            changes["group_size"] = None
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizationArgs:
        """Build from a recipe mapping; an unknown field is an error listing the valid ones."""
        if isinstance(data, QuantizationArgs):
            return data
        if not isinstance(data, dict):
            raise RecipeError(f"quantization args must be a mapping, got {data!r}")
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in data if k not in valid]
        if unknown:
            raise RecipeError(f"unknown quantization field(s) {', '.join(map(repr, unknown))}; "
                              f"valid fields: {', '.join(valid)}")
        data = dict(data)
        if data.get("strategy") in ("tensor", "channel") and "group_size" not in data:
            data["group_size"] = None
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class QuantizationScheme:
    """Weight quantization ``weights`` applied to modules matching ``targets``."""

    weights: QuantizationArgs
    targets: tuple[str, ...] = ("Linear",)

    def __post_init__(self) -> None:
        if not isinstance(self.weights, QuantizationArgs):
            raise RecipeError(f"QuantizationScheme.weights must be QuantizationArgs, got {self.weights!r}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        else:
            object.__setattr__(self, "targets", tuple(self.targets))
