"""Built-in modifiers (compression algorithms), registered by name for recipes."""

from layerwise.hookspecs import hookimpl

from .gptq import GPTQModifier
from .quantization import QuantizationModifier
from .sparsegpt import SparseGPTModifier
from .wanda import WandaModifier

MODIFIERS = [
    ("QuantizationModifier", QuantizationModifier),
    ("GPTQModifier", GPTQModifier),
    ("SparseGPTModifier", SparseGPTModifier),
    ("WandaModifier", WandaModifier),
]


@hookimpl
def layerwise_register_modifiers(register):
    for name, cls in MODIFIERS:
        register(name, cls)
