"""Llama family (Llama 2/3, and the decoders that share its layout): one decoder layer at a time."""

from __future__ import annotations

from typing import Any

import torch

from layerwise import ModelPatch, hookimpl
from layerwise.plugin import TESTED_TRANSFORMERS
from layerwise.plugin.quantization import LLAMA_LIKE

from . import _tiny


def sample_inputs(config: Any, modality: str = "text", batch: int = 2, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Random token ids with a full attention mask; text only."""
    if modality != "text":
        raise ValueError(f"Llama models take text only, not {modality!r}")
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def tiny_llama() -> torch.nn.Module:
    """A seeded 2-layer Llama."""
    from transformers import LlamaConfig

    return _tiny.seeded("LlamaForCausalLM", LlamaConfig(**_tiny.TEXT))


LLAMA = ModelPatch(
    name="llama",
    model_types=("llama",),
    architectures=("LlamaForCausalLM", "LlamaModel"),
    sequential_targets=("LlamaDecoderLayer",),
    # the output head maps to the vocabulary: quantizing it costs the most quality per byte
    ignore=("lm_head",),
    sample_inputs=sample_inputs,
    tiny_models=(tiny_llama,),
    smoothing_mappings=(
        (("re:.*q_proj", "re:.*k_proj", "re:.*v_proj"), "re:.*input_layernorm"),
        (("re:.*gate_proj", "re:.*up_proj"), "re:.*post_attention_layernorm"),
        # exact when o_proj reads as many channels as v_proj makes (no grouped-query attention): else skipped
        (("re:.*o_proj",), "re:.*v_proj"),
        # act(gate) * up is elementwise per channel, so up's output channels carry a scale into down
        # (measured: AWQ 3-bit on tiny-llama-doc, ppl 33.378 without this mapping, 33.318 with it)
        (("re:.*down_proj",), "re:.*up_proj"),
    ),
    # pre-norm blocks and a final norm before lm_head: the residual stream rotates exactly
    rotation_layout=LLAMA_LIKE,
    verified_transformers=TESTED_TRANSFORMERS.releases,
)


@hookimpl
def layerwise_register_model_patches(register):
    register(LLAMA)
