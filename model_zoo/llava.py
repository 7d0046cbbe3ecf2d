"""Llava (CLIP / SigLIP / Pixtral vision towers) and Mistral3: vision encoder layers and decoder
layers calibrated one at a time.

Llava pairs any vision tower with any decoder, so the targets are name patterns (every layer
under ``vision_tower``, every layer of ``language_model``) rather than class names. Pixtral-12B
is published as a Llava model with a Pixtral tower and a Mistral decoder; Mistral3 (Mistral
Small 3.x) uses the same tower and merges ``spatial_merge_size**2`` patches into one token.

Image tokens per image: ``(height / patch) * (width / patch)`` patch features, minus nothing and
plus the CLS token for CLIP-style towers under ``vision_feature_select_strategy="full"``
(``"default"`` drops CLS); Mistral3 divides by ``spatial_merge_size**2``. Pixtral towers also
take ``image_sizes`` (``(images, 2)``, height and width in pixels).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from layerwise import ModelPatch, hookimpl
from layerwise.plugin import TESTED_TRANSFORMERS

from . import _inputs, _tiny
from ._names import LM_HEAD
from ._rotation import text_tower_layout

#: every transformer layer of the vision tower (CLIP/SigLIP ``encoder.layers``, Pixtral ``transformer.layers``)
VISION_LAYERS = "re:(.*\\.)?vision_tower\\..*layers\\.\\d+"
#: every decoder layer of the language model, whatever its class
TEXT_LAYERS = "re:(.*\\.)?language_model\\.(model\\.)?layers\\.\\d+"


def image_token_count(config: Any) -> int:
    """How many image placeholder tokens one ``image_size`` image takes in the text."""
    vision = config.vision_config
    height, width = _inputs.pair(vision.image_size)
    patch = _inputs.pair(vision.patch_size)[0]
    count = (height // patch) * (width // patch)
    if getattr(config, "model_type", "") == "mistral3":
        return count // config.spatial_merge_size**2
    has_cls = vision.model_type not in ("pixtral", "siglip_vision_model")
    if has_cls and getattr(config, "vision_feature_select_strategy", "default") == "full":
        count += 1
    return count


def sample_inputs(config: Any, modality: str = "text", batch: int = 2, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Text ids, or one ``image_size`` image per row with its run of placeholder tokens."""
    _inputs.check_modality("Llava", modality, (_inputs.TEXT, _inputs.IMAGE))
    text = config.text_config
    avoid = _inputs.special_ids(config, text)
    if modality == _inputs.TEXT:
        return _inputs.text_inputs(text.vocab_size, batch, seq_len, avoid=avoid)

    vision = config.vision_config
    run = [config.image_token_index] * image_token_count(config)
    input_ids = _inputs.image_prompt(text.vocab_size, run, batch, avoid=avoid)
    height, width = _inputs.pair(vision.image_size)
    inputs = {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": _inputs.pixels(batch, vision.num_channels, height, width),
    }
    if vision.model_type == "pixtral":
        inputs["image_sizes"] = torch.tensor([[height, width]] * batch)
    return inputs


_PIXTRAL_TOWER = dict(_tiny.VISION, model_type="pixtral", image_size=56, patch_size=14, head_dim=16)


def tiny_llava() -> torch.nn.Module:
    """A seeded Llava: CLIP vision tower, Llama decoder."""
    from transformers import LlavaConfig

    config = LlavaConfig(
        vision_config=dict(_tiny.VISION, model_type="clip_vision_model", image_size=28, patch_size=14,
                           projection_dim=32),
        text_config=dict(_tiny.TEXT, model_type="llama"),
        image_token_index=250, image_seq_length=4, vision_feature_layer=-1)
    return _tiny.seeded("LlavaForConditionalGeneration", config)


def tiny_pixtral() -> torch.nn.Module:
    """Pixtral-12B's layout: a Llava model with a Pixtral vision tower and a Mistral decoder."""
    from transformers import LlavaConfig

    config = LlavaConfig(vision_config=_PIXTRAL_TOWER, text_config=dict(_tiny.TEXT, model_type="mistral", head_dim=16),
                         image_token_index=250, vision_feature_select_strategy="full", vision_feature_layer=-1)
    return _tiny.seeded("LlavaForConditionalGeneration", config)


def tiny_mistral3() -> torch.nn.Module:
    """A seeded Mistral3: Pixtral tower, patch merger, Mistral decoder."""
    from transformers import Mistral3Config

    config = Mistral3Config(vision_config=_PIXTRAL_TOWER, text_config=dict(_tiny.TEXT, model_type="mistral", head_dim=16),
                            image_token_index=250, spatial_merge_size=2, vision_feature_layer=-1,
                            tie_word_embeddings=False)
    return _tiny.seeded("Mistral3ForConditionalGeneration", config)


_TARGETS = (VISION_LAYERS, TEXT_LAYERS)
_IGNORE = (LM_HEAD, "re:.*multi_modal_projector.*")
#: the KV cache is the decoder's (whatever its family: Llama, Mistral, Qwen2): the vision tower caches nothing
_ATTENTION = ("re:.*language_model\\.layers\\.\\d+\\.self_attn",)

_VISION = "re:.*vision_tower\\..*"
#: the decoder's norms and projections; in the vision tower, one pattern covers both layouts the patch
#: takes: CLIP / SigLIP (layer_norm1 -> self_attn, layer_norm2 -> mlp.fc1) and Pixtral (attention_norm
#: -> attention, ffn_norm -> feed_forward gate/up)
_MAPPINGS = (
    (("re:.*language_model.*q_proj", "re:.*language_model.*k_proj", "re:.*language_model.*v_proj"),
     "re:.*language_model.*input_layernorm"),
    (("re:.*language_model.*gate_proj", "re:.*language_model.*up_proj"),
     "re:.*language_model.*post_attention_layernorm"),
    (("re:.*language_model.*o_proj",), "re:.*language_model.*v_proj"),
    ((_VISION + "(self_attn|attention)\\.[qkv]_proj",), _VISION + "(layer_norm1|attention_norm)"),
    ((_VISION + "(mlp\\.fc1|feed_forward\\.(gate|up)_proj)",), _VISION + "(layer_norm2|ffn_norm)"),
    ((_VISION + "(self_attn\\.out_proj|attention\\.o_proj)",), _VISION + "v_proj"),
)

LLAVA = ModelPatch(
    name="llava",
    model_types=("llava",),
    architectures=("LlavaForConditionalGeneration", "LlavaModel"),
    sequential_targets=_TARGETS,
    ignore=_IGNORE,
    attention_modules=_ATTENTION,
    sample_inputs=sample_inputs,
    tiny_models=(tiny_llava, tiny_pixtral),
    smoothing_mappings=_MAPPINGS,
    # the decoder's residual stream, the projector writing the image tokens' embeddings into it
    rotation_layout=text_tower_layout("model.language_model", projector="model.multi_modal_projector.linear_2"),
    verified_transformers=TESTED_TRANSFORMERS.releases,
)

# Mistral3 (Pixtral tower + Mistral decoder) takes the same path under other class names
MISTRAL3 = dataclasses.replace(LLAVA, name="mistral3", model_types=("mistral3",),
                               architectures=("Mistral3ForConditionalGeneration", "Mistral3Model"),
                               tiny_models=(tiny_mistral3,))


#: text-only calibration never runs the vision tower
TARGETS_BY_MODALITY = {name: {"text": (TEXT_LAYERS,), "image": _TARGETS} for name in ("llava", "mistral3")}


@hookimpl
def layerwise_register_model_patches(register):
    register(LLAVA)
    register(MISTRAL3)
