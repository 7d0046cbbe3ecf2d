"""Which weights to prune: mask structures and exact, score-based mask selection.

A *mask structure* is ``"0:0"`` (unstructured: any weights, a fraction of each comparison
group) or ``"N:M"``: in every run of ``M`` consecutive input columns of a row, exactly
``N`` weights are pruned (``"2:4"``: half, the pattern sparse tensor cores run). Masks here
are boolean tensors of the weight's ``(out, in)`` shape, ``True`` where a weight is
**pruned**. Selection is exact: a row always loses ``round(sparsity * in)`` weights
(ties broken by position), never "everything at or below a threshold".
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import Tensor

from layerwise.errors import RecipeError

_PATTERN = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


@dataclass(frozen=True)
class MaskStructure:
    """``n`` of every ``m`` consecutive weights pruned; ``n == m == 0`` is unstructured."""

    n: int
    m: int

    @property
    def unstructured(self) -> bool:
        return self.m == 0

    @property
    def sparsity(self) -> float | None:
        """The fraction an N:M structure prunes (``None`` for unstructured: the recipe says)."""
        return None if self.unstructured else self.n / self.m

    def __str__(self) -> str:
        return "unstructured" if self.unstructured else f"{self.n}:{self.m}"

    def check_columns(self, columns: int, layer: str) -> None:
        """An N:M structure needs whole runs of ``m`` columns: an error naming the layer otherwise."""
        if not self.unstructured and columns % self.m:
            raise RecipeError(f"mask_structure {self.n}:{self.m} needs the input width of every targeted layer "
                              f"to be a multiple of {self.m}, but layer {layer!r} has {columns} input columns; "
                              f"add {layer!r} to ignore, or use mask_structure '0:0' (unstructured)")


def parse_mask_structure(value: object, owner: str = "mask_structure") -> MaskStructure:
    """``"0:0"``, ``"unstructured"`` or ``"N:M"`` with ``0 < N < M`` -> :class:`MaskStructure`."""
    if isinstance(value, MaskStructure):
        return value
    if value is None or (isinstance(value, str) and value.strip().lower() == "unstructured"):
        return MaskStructure(0, 0)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 60 and value % 60:
        n, m = divmod(value, 60)  # YAML 1.1 reads an unquoted 2:4 as the base-60 number 124
        raise RecipeError(f"{owner} is the number {value}, which is how YAML reads an unquoted {n}:{m}; "
                          f"quote it: mask_structure: \"{n}:{m}\"")
    match = _PATTERN.match(value) if isinstance(value, str) else None
    if match is None:
        raise RecipeError(f"{owner} must be '0:0' (unstructured) or 'N:M' such as '2:4' (N of every M "
                          f"consecutive weights pruned), got {value!r}")
    n, m = int(match.group(1)), int(match.group(2))
    if n == m == 0:
        return MaskStructure(0, 0)
    if not 0 < n < m:
        raise RecipeError(f"{owner} {value!r}: N:M needs 0 < N < M (N pruned in every M consecutive weights); "
                          f"e.g. '2:4'")
    return MaskStructure(n, m)


def check_sparsity(value: object, owner: str) -> float:
    """A sparsity fraction in ``[0, 1)``, else an error naming the field."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 <= value < 1):
        raise RecipeError(f"{owner} must be a fraction in [0, 1) (0.5 prunes half the weights), got {value!r}")
    return float(value)


def pruned_count(columns: int, sparsity: float) -> int:
    """How many of ``columns`` weights a fraction ``sparsity`` prunes (rounded to nearest)."""
    return min(columns, math.floor(sparsity * columns + 0.5))


def score_mask(score: Tensor, structure: MaskStructure, sparsity: float) -> Tensor:
    """Prune the lowest-``score`` weights: per row (unstructured) or per run of ``m`` columns (N:M).

    ``score`` is ``(out, in)``; higher means more important. Unstructured: each row loses
    exactly ``round(sparsity * in)`` weights. N:M: each run of ``m`` loses exactly ``n``.
    """
    rows, columns = score.shape
    if not structure.unstructured:
        structure.check_columns(columns, "(this weight)")
        runs = score.reshape(rows, columns // structure.m, structure.m)
        drop = torch.topk(runs, structure.n, dim=-1, largest=False, sorted=False).indices
        mask = torch.zeros_like(runs, dtype=torch.bool).scatter_(-1, drop, True)
        return mask.reshape(rows, columns)
    k = pruned_count(columns, sparsity)
    mask = torch.zeros(rows, columns, dtype=torch.bool, device=score.device)
    if k:
        drop = torch.topk(score, k, dim=1, largest=False, sorted=False).indices
        mask.scatter_(1, drop, True)
    return mask


def magnitude_mask(weight: Tensor, structure: MaskStructure, sparsity: float) -> Tensor:
    """The plain baseline: prune the smallest ``|w|`` of each row (or each run of ``m``)."""
    return score_mask(weight.detach().abs().to(torch.float32), structure, sparsity)
