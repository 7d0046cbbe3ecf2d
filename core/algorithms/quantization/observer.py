"""The observer interface: how a quantization range is measured, for weights and for activations.

An observer is built with the tensor's :class:`~layerwise.algorithms.quantization.args.QuantizationArgs`.
For a weight it is called once: ``observer(weight) -> (min_vals, max_vals)`` in the qparam shape
of the args; an NVFP4 weight's observer is also given the tensor's ``global_scale`` (its block scales are
relative to it, so a search over block ranges needs it; min-max does not). For a layer's input activations (static quantization) it sees every calibration
batch through :meth:`Observer.update` and gives the calibrated range with :meth:`Observer.result`.
:func:`~layerwise.algorithms.quantization.qmath.compute_qparams` turns either into scale and zero point.
Observers are plugins (``layerwise_register_observers``); a recipe picks one by name
(``observer: mse``).

In a distributed run each rank's activation observer saw its share of the batches;
:meth:`Observer.reduce` gathers every rank's range and batch count and :meth:`Observer.merge`
combines them: the widest range for min-max (exact), a subclass's own rule otherwise.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import activation_min_max, weight_min_max


class Observer:
    """Min-max by default: subclasses change :meth:`reduce_weight` and/or :meth:`combine`."""

    #: a weight's range for its channel, group or block strategy depends on the rows it covers alone, bit for
    #: bit whatever the rows around them, so the weight may be observed in chunks of whole rows (a model-free
    #: run does, to bound its memory). Min-max is (minima and maxima are exact in any order); a subclass that
    #: overrides :meth:`reduce_weight` is taken not to be unless it says so (MSE's means are sums whose order,
    #: and so their last bits, may change with the tensor's size and threads).
    rows_independent: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "reduce_weight" in cls.__dict__ and "rows_independent" not in cls.__dict__:
            cls.rows_independent = False

    def __init__(self, args: QuantizationArgs) -> None:
        self.args = args
        self.min_vals: Tensor | None = None
        self.max_vals: Tensor | None = None
        self.batches = 0

    def __call__(self, weight: Tensor, global_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        if global_scale is None:  # an observer written before NVFP4 keeps its one-argument reduce_weight
            return self.reduce_weight(weight)
        return self.reduce_weight(weight, global_scale=global_scale)

    def reduce_weight(self, weight: Tensor, global_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """A weight's range in the qparam shape of the args (``global_scale``: NVFP4's, unused by min-max)."""
        return weight_min_max(weight, self.args)

    def reduce_activation(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """One batch's range (per tensor: static activations take one scale, NVFP4 inputs one global scale)."""
        values = x.detach().to(torch.float32)
        if self.args.strategy == "tensor_group":  # the block scales are dynamic; the global one is calibrated
            low, high = torch.aminmax(values)  # one pass (without a dim the fused kernel is the faster one)
            return low.reshape(1), high.reshape(1)
        return activation_min_max(values, self.args)

    @torch.no_grad()
    def update(self, x: Tensor) -> None:
        """Fold one batch of a layer's inputs into the running range."""
        low, high = self.reduce_activation(x)
        if self.min_vals is None:
            self.min_vals, self.max_vals = low, high
        else:
            self.min_vals, self.max_vals = self.combine(low, high)
        self.batches += 1

    def combine(self, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
        """The running range after a new batch's ``(low, high)``: the widest seen."""
        return torch.minimum(self.min_vals, low), torch.maximum(self.max_vals, high)

    def reduce(self, reducer) -> None:
        """Combine the ranks' activation ranges (a :class:`~layerwise.runtime.distributed.Reducer`); every rank
        ends with the same range and the total batch count."""
        states = [s for s in reducer.gather((self.min_vals, self.max_vals, self.batches)) if s[0] is not None]
        if not states:
            return
        device = self.min_vals.device if self.min_vals is not None else states[0][0].device
        low, high = self.merge([(lo.to(device), hi.to(device), n) for lo, hi, n in states])
        self.min_vals, self.max_vals = low, high
        self.batches = sum(n for _, _, n in states)

    def merge(self, states: list[tuple[Tensor, Tensor, int]]) -> tuple[Tensor, Tensor]:
        """The range after every rank's ``(low, high, batches)`` (ranks with data only, in rank order):
        min-max's widest."""
        low, high = states[0][0], states[0][1]
        for other_low, other_high, _ in states[1:]:
            low, high = torch.minimum(low, other_low), torch.maximum(high, other_high)
        return low, high

    def result(self) -> tuple[Tensor, Tensor]:
        """The calibrated range; an error if no batch was seen."""
        if self.min_vals is None or self.max_vals is None:
            raise ValueError("the observer saw no calibration data")
        return self.min_vals, self.max_vals
