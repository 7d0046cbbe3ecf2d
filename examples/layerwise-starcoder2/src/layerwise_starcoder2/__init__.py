"""An example layerwise plugin: a StarCoder2 model patch and a toy pruning modifier."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from layerwise import ModelPatch, Modifier, hookimpl
from layerwise.plugin import find_modules


def sample_inputs(config, modality: str = "text", batch: int = 2, seq_len: int = 16) -> dict:
    """Random token ids with a full attention mask: what tracing and the plugin kit feed the model."""
    if modality != "text":
        raise ValueError(f"StarCoder2 takes text only, not {modality!r}")
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def tiny_starcoder2() -> torch.nn.Module:
    """A seeded 2-layer StarCoder2 built from its config (no download): what the kit checks the patch on."""
    from transformers import Starcoder2Config, Starcoder2ForCausalLM

    torch.manual_seed(0)
    config = Starcoder2Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              bos_token_id=0, eos_token_id=0)
    return Starcoder2ForCausalLM(config).eval()


STARCODER2 = ModelPatch(
    name="starcoder2",
    model_types=("starcoder2",),
    architectures=("Starcoder2ForCausalLM",),
    sequential_targets=("Starcoder2DecoderLayer",),
    ignore=("lm_head",),
    sample_inputs=sample_inputs,
    tiny_models=(tiny_starcoder2,),
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
