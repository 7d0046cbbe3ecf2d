"""Idefics3 (and SmolVLM's layout): vision encoder layers and text decoder layers calibrated one
at a time.

An image is ``pixel_values`` ``(batch, images, channels, image_size, image_size)`` with a
boolean ``pixel_attention_mask`` ``(batch, images, image_size, image_size)``. The connector's
pixel shuffle folds ``scale_factor**2`` patches into one token, so an image takes
``(image_size / patch)**2 / scale_factor**2`` ``<image>`` tokens in the text.
"""

from __future__ import annotations

from typing import Any

import torch

from layerwise import ModelPatch, hookimpl

from . import _inputs

VISION_LAYERS = "re:(.*\\.)?vision_model\\.encoder\\.layers\\.\\d+"
TEXT_LAYERS = "re:(.*\\.)?text_model\\.layers\\.\\d+"


def image_token_count(config: Any) -> int:
    vision = config.vision_config
    side = _inputs.pair(vision.image_size)[0] // _inputs.pair(vision.patch_size)[0]
    return side * side // config.scale_factor**2


def sample_inputs(config: Any, modality: str = "text", batch: int = 2, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Text ids, or one full-size image per row with its pixel mask and ``<image>`` run."""
    _inputs.check_modality("Idefics3", modality, (_inputs.TEXT, _inputs.IMAGE))
    text = config.text_config
    avoid = _inputs.special_ids(config, text)
    if modality == _inputs.TEXT:
        return _inputs.text_inputs(text.vocab_size, batch, seq_len, avoid=avoid)

    vision = config.vision_config
    size = _inputs.pair(vision.image_size)
    input_ids = _inputs.image_prompt(text.vocab_size, [config.image_token_id] * image_token_count(config), batch,
                                     avoid=avoid)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": _inputs.pixels(batch, 1, vision.num_channels, *size),
        "pixel_attention_mask": torch.ones(batch, 1, *size, dtype=torch.bool),
    }


IDEFICS3 = ModelPatch(
    name="idefics3",
    model_types=("idefics3", "smolvlm"),
    architectures=("Idefics3ForConditionalGeneration", "Idefics3Model",
                   "SmolVLMForConditionalGeneration", "SmolVLMModel"),
    sequential_targets=(VISION_LAYERS, TEXT_LAYERS),
    # the connector (pixel shuffle + projection) maps vision features into the text width
    ignore=("lm_head", "re:.*connector.*"),
    sample_inputs=sample_inputs,
    verified_transformers=("5.23.0",),
)


#: text-only calibration never runs the vision encoder
TARGETS_BY_MODALITY = {"idefics3": {"text": (TEXT_LAYERS,), "image": IDEFICS3.sequential_targets}}


@hookimpl
def layerwise_register_model_patches(register):
    register(IDEFICS3)
