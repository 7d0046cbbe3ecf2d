"""Built-in modifiers (compression algorithms), registered by name for recipes."""

from layerwise.plugin import hookimpl

from .autoround import AutoRoundModifier
from .awq import AWQModifier
from .gptq import GPTQModifier
from .quantization import QuantizationModifier
from .rotation import RotationModifier
from .smoothquant import SmoothQuantModifier
from .sparsegpt import SparseGPTModifier
from .wanda import WandaModifier

MODIFIERS = [
    ("QuantizationModifier", QuantizationModifier),
    ("GPTQModifier", GPTQModifier),
    ("SparseGPTModifier", SparseGPTModifier),
    ("WandaModifier", WandaModifier),
    ("AWQModifier", AWQModifier),
    ("SmoothQuantModifier", SmoothQuantModifier),
    ("AutoRoundModifier", AutoRoundModifier),
    ("RotationModifier", RotationModifier),
]


@hookimpl
def layerwise_register_modifiers(register):
    for name, cls in MODIFIERS:
        register(name, cls)
