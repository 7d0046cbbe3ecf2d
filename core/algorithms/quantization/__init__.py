"""Weight quantization: settings (:mod:`.args`), presets, arithmetic (:mod:`.qmath`), storage on modules."""

from layerwise.algorithms.quantization.args import QuantizationArgs, QuantizationScheme
from layerwise.algorithms.quantization.presets import PRESETS, resolve_scheme
from layerwise.algorithms.quantization.qmath import (
    compute_qparams,
    dequantize,
    fake_quantize,
    fake_quantize_weight,
    qrange,
    quantize,
    weight_qparams,
)
from layerwise.algorithms.quantization.storage import quantized_modules, set_quantized_weight

__all__ = [
    "PRESETS", "QuantizationArgs", "QuantizationScheme", "compute_qparams", "dequantize", "fake_quantize",
    "fake_quantize_weight", "qrange", "quantize", "quantized_modules", "resolve_scheme", "set_quantized_weight",
    "weight_qparams",
]
