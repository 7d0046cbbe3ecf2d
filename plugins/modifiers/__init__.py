"""Built-in modifiers (compression algorithms), registered by name for recipes."""

from layerwise.hookspecs import hookimpl

from .gptq import GPTQModifier
from .quantization import QuantizationModifier

MODIFIERS = [
    ("QuantizationModifier", QuantizationModifier),
    ("GPTQModifier", GPTQModifier),
]


@hookimpl
def layerwise_register_modifiers(register):
    for name, cls in MODIFIERS:
        register(name, cls)
