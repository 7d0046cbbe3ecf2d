"""Weight quantization: settings (:mod:`.args`), presets, arithmetic (:mod:`.qmath`), storage on modules."""

from .args import QuantizationArgs, QuantizationScheme
from .presets import PRESETS, resolve_scheme
from .qmath import (compute_qparams, dequantize, fake_quantize, fake_quantize_weight, qrange, quantize,
                    weight_qparams)
from .storage import quantized_modules, set_quantized_weight

__all__ = [
    "QuantizationArgs", "QuantizationScheme", "PRESETS", "resolve_scheme", "qrange", "compute_qparams",
    "quantize", "dequantize", "fake_quantize", "weight_qparams", "fake_quantize_weight",
    "set_quantized_weight", "quantized_modules",
]
