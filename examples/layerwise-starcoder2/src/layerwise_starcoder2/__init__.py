"""An example layerwise plugin: a StarCoder2 model patch and a toy pruning modifier."""

from __future__ import annotations

from dataclasses import dataclass, field

from layerwise import ModelPatch, Modifier, hookimpl
from layerwise.matching import find_modules

STARCODER2 = ModelPatch(
    name="starcoder2",
    model_types=("starcoder2",),
    architectures=("Starcoder2ForCausalLM",),
    sequential_targets=("Starcoder2DecoderLayer",),
    ignore=("lm_head",),
    verified_transformers=("5.23.0", "5.24.0"),
)


@dataclass
class MagnitudePruningModifier(Modifier):
    """Zero the ``sparsity`` fraction of smallest-magnitude weights in each targeted Linear."""

    requires_data = False

    sparsity: float = 0.5
    targets: list[str] = field(default_factory=lambda: ["Linear"])
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {self.sparsity}")

    def on_calibration_end(self, state) -> None:
        for module in find_modules(state.model, self.targets, [*self.ignore, *state.ignore]).values():
            weight = module.weight.data
            count = int(weight.numel() * self.sparsity)
            if count == 0:
                continue
            threshold = weight.abs().flatten().kthvalue(count).values
            weight.masked_fill_(weight.abs() <= threshold, 0.0)


@hookimpl
def layerwise_register_model_patches(register):
    register(STARCODER2)


@hookimpl
def layerwise_register_modifiers(register):
    register("MagnitudePruningModifier", MagnitudePruningModifier)
