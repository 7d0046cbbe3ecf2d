"""Min-max observers: the range is the smallest and largest value seen."""

from __future__ import annotations

import torch
from torch import Tensor

from layerwise.plugin.quantization import Observer


class MinMaxObserver(Observer):
    """A weight's own min and max; for activations, the widest range over every calibration batch."""


class MovingAverageMinMaxObserver(Observer):
    """For activations, an exponential moving average of each batch's min and max (weight 0.01 per new
    batch): one outlier batch moves the range a little instead of setting it. Weights: as min-max."""

    #: the weight of each new batch
    averaging_constant = 0.01

    def combine(self, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
        c = self.averaging_constant
        return torch.lerp(self.min_vals, low, c), torch.lerp(self.max_vals, high, c)

    def merge(self, states: list[tuple[Tensor, Tensor, int]]) -> tuple[Tensor, Tensor]:
        """Several ranks: the ranks' averages weighted by their batch counts. An approximation: one
        process would have run a single average over every batch in order, which no split reproduces
        (the ranks' averages each start from their own first batch)."""
        total = sum(n for _, _, n in states)
        low = sum(lo * (n / total) for lo, _, n in states)
        high = sum(hi * (n / total) for _, hi, n in states)
        return low, high
