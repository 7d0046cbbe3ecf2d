"""The min-max observer: the range of a weight is its smallest and largest value."""

from __future__ import annotations

from torch import Tensor

from layerwise.quantization.args import QuantizationArgs
from layerwise.quantization.qmath import weight_min_max


class MinMaxObserver:
    """``MinMaxObserver(args)(weight) -> (min_vals, max_vals)`` in the qparam shape of ``args``.

    Observers share this interface: constructed with the :class:`QuantizationArgs`,
    called with a ``(out, in)`` weight, returning reduced minima and maxima that
    :func:`~layerwise.quantization.qmath.compute_qparams` turns into scale / zero point.
    """

    def __init__(self, args: QuantizationArgs) -> None:
        self.args = args

    def __call__(self, weight: Tensor) -> tuple[Tensor, Tensor]:
        return weight_min_max(weight, self.args)
