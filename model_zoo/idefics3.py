"""Idefics3 (and SmolVLM's layout): vision encoder layers and text decoder layers calibrated one
at a time.

An image is ``pixel_values`` ``(batch, images, channels, image_size, image_size)`` with a
boolean ``pixel_attention_mask`` ``(batch, images, image_size, image_size)``. The connector's
pixel shuffle folds ``scale_factor**2`` patches into one token, so an image takes
``(image_size / patch)**2 / scale_factor**2`` ``<image>`` tokens in the text.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from layerwise import ModelPatch, hookimpl
from layerwise.plugin import TESTED_TRANSFORMERS, opaque

from . import _inputs, _tiny
from ._rotation import text_tower_layout

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


@opaque
def drop_padding_images(pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None, patch_size: int,
                        dtype: torch.dtype, keep_one: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The real images of ``(batch, images, C, H, W)`` pixels and their patch mask.

    Padding images (all zeros) are dropped by value, so the result's length depends on the data:
    one opaque call, run at replay. ``keep_one`` keeps an empty first image when no image is
    real (SmolVLM).
    """
    batch, images = pixel_values.shape[:2]
    pixel_values = pixel_values.to(dtype=dtype).view(batch * images, *pixel_values.shape[2:])
    real = (pixel_values == 0.0).sum(dim=(-1, -2, -3)) != pixel_values.shape[1:].numel()
    if keep_one:
        real[0] |= ~torch.any(real)
    pixel_values = pixel_values[real].contiguous()
    if pixel_attention_mask is None:
        mask = torch.ones([pixel_values.shape[i] for i in (0, 2, 3)], dtype=torch.bool, device=pixel_values.device)
    else:
        mask = pixel_attention_mask.view(batch * images, *pixel_attention_mask.shape[2:])[real].contiguous()
    subgrid = mask.unfold(dimension=1, size=patch_size, step=patch_size)
    subgrid = subgrid.unfold(dimension=2, size=patch_size, step=patch_size)
    return pixel_values, (subgrid.sum(dim=(-1, -2)) > 0).bool()


def _get_image_features(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor | None = None,
                        return_dict: bool | None = True, **kwargs: Any) -> Any:
    """``get_image_features`` with the vision encoder traced, layer by layer.

    transformers' version drops padding images by value and splits the features per sample
    by value (``tolist``) around the encoder, so the tracer would wrap the whole call, vision
    layers included. Here the dropping is one opaque call and ``pooler_output`` holds one
    tensor of every real image's tokens (the model's forward concatenates the per-sample list
    anyway, so its result is the same).
    """
    pixel_values, patch_attention_mask = drop_padding_images(
        pixel_values, pixel_attention_mask, self.config.vision_config.patch_size, self.dtype,
        type(self).__name__.startswith("SmolVLM"))
    image_outputs = self.vision_model(pixel_values=pixel_values, patch_attention_mask=patch_attention_mask,
                                      return_dict=True, **kwargs)
    features = self.connector(image_outputs.last_hidden_state)
    image_outputs.pooler_output = [features.reshape(-1, features.shape[-1])]
    return image_outputs if return_dict is not False else image_outputs.to_tuple()


def traceable_image_features(model: torch.nn.Module) -> None:
    """Give every Idefics3/SmolVLM base model the traceable ``get_image_features`` (instance attribute)."""
    for module in model.modules():
        if type(module).__name__ in ("Idefics3Model", "SmolVLMModel"):
            module.get_image_features = types.MethodType(_get_image_features, module)


def tiny_idefics3() -> torch.nn.Module:
    """A seeded Idefics3: SigLIP-style encoder, pixel-shuffle connector, Llama decoder."""
    from transformers import Idefics3Config

    config = Idefics3Config(vision_config=dict(_tiny.VISION, image_size=56, patch_size=14),
                            text_config=dict(_tiny.TEXT, model_type="llama", pad_token_id=0),
                            image_token_id=250, scale_factor=2)
    return _tiny.seeded("Idefics3ForConditionalGeneration", config)


IDEFICS3 = ModelPatch(
    name="idefics3",
    model_types=("idefics3", "smolvlm"),
    architectures=("Idefics3ForConditionalGeneration", "Idefics3Model",
                   "SmolVLMForConditionalGeneration", "SmolVLMModel"),
    sequential_targets=(VISION_LAYERS, TEXT_LAYERS),
    # the connector (pixel shuffle + projection) maps vision features into the text width
    ignore=("lm_head", "re:.*connector.*"),
    apply=traceable_image_features,
    # the KV cache is the text decoder's: the SigLIP-style encoder caches nothing
    attention_modules=("re:.*text_model\\.layers\\.\\d+\\.self_attn",),
    sample_inputs=sample_inputs,
    tiny_models=(tiny_idefics3,),
    smoothing_mappings=(
        (("re:.*text_model.*q_proj", "re:.*text_model.*k_proj", "re:.*text_model.*v_proj"),
         "re:.*text_model.*input_layernorm"),
        (("re:.*text_model.*gate_proj", "re:.*text_model.*up_proj"), "re:.*text_model.*post_attention_layernorm"),
        (("re:.*text_model.*o_proj",), "re:.*text_model.*v_proj"),
        # the SigLIP-style encoder: layer_norm1 feeds q/k/v, layer_norm2 the MLP's fc1
        (("re:.*vision_model.*self_attn\\.[qkv]_proj",), "re:.*vision_model.*layer_norm1"),
        (("re:.*vision_model.*mlp\\.fc1",), "re:.*vision_model.*layer_norm2"),
        (("re:.*vision_model.*out_proj",), "re:.*vision_model.*v_proj"),
    ),
    # the decoder's residual stream, the connector's projection writing the image tokens' embeddings into it
    rotation_layout=text_tower_layout("model.text_model", projector="model.connector.modality_projection.proj"),
    verified_transformers=TESTED_TRANSFORMERS.releases,
)


#: text-only calibration never runs the vision encoder
TARGETS_BY_MODALITY = {"idefics3": {"text": (TEXT_LAYERS,), "image": IDEFICS3.sequential_targets}}


@hookimpl
def layerwise_register_model_patches(register):
    register(IDEFICS3)
