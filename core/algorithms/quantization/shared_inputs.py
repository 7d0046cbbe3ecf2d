"""Layers that read one tensor with the same input quantization share its fake quantization.

Attention's q/k/v projections read one hidden state, a gated MLP's gate/up another: with quantized inputs
each layer fake-quantized the same tensor with the same args and (equal) scales, three times and twice
over. :func:`quantized_input` remembers the last input it quantized and gives the same result back while
that tensor, unchanged (its version counter), comes with equal args and scales. Only on the CPU, with
scales compared by value there (a comparison on an accelerator would wait for it), and not where
autograd records the input's history.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import fake_quantize_activation


@dataclass(frozen=True)
class _Quantized:
    """One fake-quantized input: what it came from (the tensor, its version, the args, the scales' values)."""

    source: weakref.ref
    version: int
    args: QuantizationArgs
    qparams: tuple[Tensor | None, ...]
    result: Tensor
    result_version: int

    def serves(self, x: Tensor, args: QuantizationArgs, qparams: tuple[Tensor | None, ...]) -> bool:
        return (self.source() is x and x._version == self.version and self.result._version == self.result_version
                and (self.args is args or self.args == args)
                and all(_same_values(a, b) for a, b in zip(self.qparams, qparams, strict=True)))


#: the last input quantized (one entry: siblings run one after another); dropped when its tensor is freed
_LAST: list[_Quantized | None] = [None]


def quantized_input(x: Tensor, args: QuantizationArgs, scale: Tensor | None = None,
                    zero_point: Tensor | None = None, global_scale: Tensor | None = None) -> Tensor:
    """:func:`~layerwise.algorithms.quantization.qmath.fake_quantize_activation` of ``x``, or the result of the
    last call when that was for this very tensor, unchanged since, with equal ``args`` and scales."""
    qparams = (scale, zero_point, global_scale)
    last = _LAST[0]
    if last is not None and last.serves(x, args, qparams):
        return last.result
    result = fake_quantize_activation(x, args, scale, zero_point, global_scale)
    if _shareable(x, qparams):
        source = weakref.ref(x, _forget)
        _LAST[0] = _Quantized(source, x._version, args, tuple(None if q is None else q.clone() for q in qparams),
                              result, result._version)
    return result


def _shareable(x: Tensor, qparams: tuple[Tensor | None, ...]) -> bool:
    """A plain CPU tensor with a version counter (no inference tensor, nor made in inference mode), outside
    autograd's recording, and scales beside it."""
    return (type(x) is Tensor and x.device.type == "cpu" and not x.is_inference()
            and not torch.is_inference_mode_enabled()
            and not (torch.is_grad_enabled() and x.requires_grad)
            and all(q is None or (q.device.type == "cpu" and not q.requires_grad) for q in qparams))


def _same_values(kept: Tensor | None, given: Tensor | None) -> bool:
    if kept is None or given is None:
        return kept is given
    return (given.device.type == "cpu" and kept.dtype == given.dtype and kept.shape == given.shape
            and torch.equal(kept, given))


def _forget(source: weakref.ref) -> None:
    """The remembered input was freed: free its result too."""
    last = _LAST[0]
    if last is not None and last.source is source:
        _LAST[0] = None
