"""Gemma3 (vision): SigLIP encoder layers and Gemma3 decoder layers calibrated one at a time.

An image is ``pixel_values`` ``(batch, channels, image_size, image_size)``; the projector pools
the patch grid down to ``mm_tokens_per_image`` soft tokens, framed in the text by
``boi_token_index`` / ``eoi_token_index``. ``token_type_ids`` (1 on image tokens) makes the
decoder attend bidirectionally inside each image, as the processor does.
"""

from __future__ import annotations

from typing import Any

import torch

from layerwise import ModelPatch, hookimpl
from layerwise.plugin import TESTED_TRANSFORMERS
from layerwise.plugin.quantization import refused_layout

from . import _inputs, _tiny
from ._names import LM_HEAD


def sample_inputs(config: Any, modality: str = "text", batch: int = 2, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Text ids, or one image per row: ``<boi>``, ``mm_tokens_per_image`` image tokens, ``<eoi>``."""
    text = getattr(config, "text_config", config)
    supported = (_inputs.TEXT, _inputs.IMAGE) if hasattr(config, "vision_config") else (_inputs.TEXT,)
    _inputs.check_modality("Gemma3", modality, supported)
    avoid = _inputs.special_ids(config, text)
    if modality == _inputs.TEXT:
        return _inputs.text_inputs(text.vocab_size, batch, seq_len, avoid=avoid)

    vision = config.vision_config
    run = [config.boi_token_index, *[config.image_token_index] * config.mm_tokens_per_image,
           config.eoi_token_index]
    input_ids = _inputs.image_prompt(text.vocab_size, run, batch, avoid=avoid)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": _inputs.pixels(batch, vision.num_channels, *_inputs.pair(vision.image_size)),
        "token_type_ids": (input_ids == config.image_token_index).long(),
    }


def tiny_gemma3() -> torch.nn.Module:
    """A seeded Gemma3: SigLIP tower, one sliding-window and one full-attention decoder layer."""
    from transformers import Gemma3Config

    config = Gemma3Config(
        # Gemma3 checkpoints have no SigLIP pooling head (vision_use_head false): an unused head would get no data
        vision_config=dict(_tiny.VISION, model_type="siglip_vision_model", image_size=56, patch_size=14,
                           vision_use_head=False),
        text_config=dict(_tiny.TEXT, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"]),
        mm_tokens_per_image=4, boi_token_index=251, eoi_token_index=252, image_token_index=250,
        tie_word_embeddings=False)
    return _tiny.seeded("Gemma3ForConditionalGeneration", config)


def tiny_gemma3_text() -> torch.nn.Module:
    """The text-only Gemma3 (1B's layout): the same decoder without a vision tower."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**dict(_tiny.TEXT, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"]))
    return _tiny.seeded("Gemma3ForCausalLM", config)


#: decoder layers, in Gemma3ForCausalLM (``model.layers``) and under the vision model (``language_model.layers``)
_TEXT = "re:(.*language_model\\.|model\\.)layers\\.\\d+\\."

GEMMA3 = ModelPatch(
    name="gemma3",
    model_types=("gemma3", "gemma3_text"),
    architectures=("Gemma3ForConditionalGeneration", "Gemma3Model", "Gemma3ForCausalLM"),
    sequential_targets=("SiglipEncoderLayer", "Gemma3DecoderLayer"),
    # the SigLIP tower stays dense: transformers cannot reload a Gemma3 checkpoint whose SigLIP Linear
    # layers are compressed (SigLIP's _init_weights reads their `.weight`, which compressed-tensors
    # replaced by packed weights); it is a small share of the model. Its layers (not their Linears)
    # are still targets, so the text decoder calibrates on real image features.
    ignore=(LM_HEAD, "re:.*multi_modal_projector.*", "re:.*vision_tower\\..*_proj", "re:.*vision_tower\\..*\\.fc[12]"),
    sample_inputs=sample_inputs,
    tiny_models=(tiny_gemma3, tiny_gemma3_text),
    # the KV cache is the text decoder's: SigLIP's attention caches nothing in vLLM
    attention_modules=("Gemma3Attention",),
    # text decoder only (the SigLIP Linear layers stay dense). Gemma norms the attention *output* with
    # post_attention_layernorm; the MLP reads pre_feedforward_layernorm
    smoothing_mappings=(
        ((_TEXT + "self_attn\\.q_proj", _TEXT + "self_attn\\.k_proj", _TEXT + "self_attn\\.v_proj"),
         _TEXT + "input_layernorm"),
        ((_TEXT + "mlp\\.gate_proj", _TEXT + "mlp\\.up_proj"), _TEXT + "pre_feedforward_layernorm"),
        ((_TEXT + "self_attn\\.o_proj",), _TEXT + "self_attn\\.v_proj"),
    ),
    rotation_layout=refused_layout(
        "its blocks normalise their attention and MLP outputs before adding them to the residual stream "
        "(post_attention_layernorm, post_feedforward_layernorm): a rotation of the stream cannot pass through "
        "those norms' per-channel weights, so folding one would change the model's outputs"),
    verified_transformers=TESTED_TRANSFORMERS.releases,
)


#: text-only calibration never runs the vision tower
TARGETS_BY_MODALITY = {"gemma3": {"text": ("Gemma3DecoderLayer",), "image": GEMMA3.sequential_targets}}


@hookimpl
def layerwise_register_model_patches(register):
    register(GEMMA3)
