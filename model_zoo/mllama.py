"""Mllama (Llama 3.2 Vision): vision encoder layers (local and global), self- and cross-attention
decoder layers, each calibrated one at a time.

An image is cut into up to ``max_num_tiles`` tiles: ``pixel_values`` is
``(batch, images, max_num_tiles, channels, image_size, image_size)``; ``aspect_ratio_ids``
(``(batch, images)``, 1-based index into ``supported_aspect_ratios``, 0 = padding) and
``aspect_ratio_mask`` (``(batch, images, max_num_tiles)``) say which tiles are real; each text
token attends to the tiles of the images it follows through ``cross_attention_mask``
(``(batch, seq, images, max_num_tiles)``). One ``<|image|>`` token marks the image in the text.
"""

from __future__ import annotations

from typing import Any

import torch

from layerwise import ModelPatch, hookimpl
from layerwise.plugin import TESTED_TRANSFORMERS, LazyFunctions

from . import _inputs, _tiny
from ._names import LM_HEAD
from ._rotation import text_tower_layout


def _tiles_for(config: Any) -> tuple[int, list[int]]:
    """The aspect-ratio id (1-based) of the largest supported layout that fits max_num_tiles."""
    vision = config.vision_config
    ratios = [list(r) for r in vision.supported_aspect_ratios]
    best = max(range(len(ratios)), key=lambda i: (ratios[i][0] * ratios[i][1] <= vision.max_num_tiles,
                                                  ratios[i][0] * ratios[i][1]))
    return best + 1, ratios[best]


def sample_inputs(config: Any, modality: str = "text", batch: int = 2, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Text ids, or one tiled image per row with its aspect-ratio tensors and cross-attention mask."""
    _inputs.check_modality("Mllama", modality, (_inputs.TEXT, _inputs.IMAGE))
    text = config.text_config
    avoid = _inputs.special_ids(config, text)
    if modality == _inputs.TEXT:
        return _inputs.text_inputs(text.vocab_size, batch, seq_len, avoid=avoid)

    vision = config.vision_config
    before, after = 2, seq_len - 3
    input_ids = _inputs.image_prompt(text.vocab_size, [config.image_token_index], batch,
                                     text_before=before, text_after=after, avoid=avoid)
    ratio_id, (rows, cols) = _tiles_for(config)
    n_tiles, max_tiles = rows * cols, vision.max_num_tiles
    size = _inputs.pair(vision.image_size)
    pixel_values = _inputs.pixels(batch, 1, max_tiles, vision.num_channels, *size)
    pixel_values[:, :, n_tiles:] = 0  # padded tiles are zeros, as the processor writes them
    aspect_ratio_mask = torch.zeros(batch, 1, max_tiles, dtype=torch.long)
    aspect_ratio_mask[:, :, :n_tiles] = 1
    # the image token and every token after it see the image's real tiles
    cross_attention_mask = torch.zeros(batch, input_ids.shape[1], 1, max_tiles, dtype=torch.long)
    cross_attention_mask[:, before:, :, :n_tiles] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
        "aspect_ratio_ids": torch.full((batch, 1), ratio_id, dtype=torch.long),
        "aspect_ratio_mask": aspect_ratio_mask,
        "cross_attention_mask": cross_attention_mask,
    }


def _opaque_functions() -> tuple:
    """The cross-attention mask builder reads mask values to find fully masked rows: opaque."""
    from transformers.models.mllama import modeling_mllama as m

    names = ("_prepare_cross_attention_mask", "_prepare_aspect_ratio_attention_mask")
    return tuple(getattr(m, n) for n in names if hasattr(m, n))


def tiny_mllama() -> torch.nn.Module:
    """A seeded Mllama: local and global vision layers, one cross-attention decoder layer of three."""
    from transformers import MllamaConfig

    config = MllamaConfig(
        vision_config=dict(hidden_size=32, attention_heads=2, num_hidden_layers=2, num_global_layers=1,
                           intermediate_size=64, image_size=28, patch_size=14, max_num_tiles=2,
                           supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]], intermediate_layers_indices=[0],
                           vision_output_dim=64),
        text_config=dict(_tiny.TEXT, num_hidden_layers=3, cross_attention_layers=[1], bos_token_id=1,
                         eos_token_id=2, pad_token_id=0),
        image_token_index=250)
    return _tiny.seeded("MllamaForConditionalGeneration", config)


MLLAMA = ModelPatch(
    name="mllama",
    model_types=("mllama",),
    architectures=("MllamaForConditionalGeneration", "MllamaModel"),
    sequential_targets=("MllamaVisionEncoderLayer", "MllamaSelfAttentionDecoderLayer",
                        "MllamaCrossAttentionDecoderLayer"),
    # the projector maps vision features into the text width; the cross-attention gates are scalars
    ignore=(LM_HEAD, "re:.*multi_modal_projector.*"),
    opaque_functions=LazyFunctions(_opaque_functions),
    sample_inputs=sample_inputs,
    tiny_models=(tiny_mllama,),
    # the KV cache is the text decoder's: its self-attention and its cross-attention (vLLM caches the image's
    # keys and values, an encoder-decoder cache; compressed-tensors gives it scales too). Only image samples reach
    # the cross-attention: text-only calibration must ignore it (ignore: [re:.*cross_attn.*]). The vision encoder
    # caches nothing
    attention_modules=("MllamaTextSelfAttention", "MllamaTextCrossAttention"),
    smoothing_mappings=(
        # a cross-attention layer's input norm feeds only its q_proj (k/v read the image states)
        (("re:.*language_model.*self_attn\\.[qkv]_proj", "re:.*language_model.*cross_attn\\.q_proj"),
         "re:.*language_model.*input_layernorm"),
        (("re:.*language_model.*gate_proj", "re:.*language_model.*up_proj"),
         "re:.*language_model.*post_attention_layernorm"),
        (("re:.*language_model.*o_proj",), "re:.*language_model.*v_proj"),
        # local and global vision layers: input_layernorm feeds q/k/v, post_attention_layernorm the MLP's fc1
        (("re:.*vision_model.*self_attn\\.[qkv]_proj",), "re:.*vision_model.*input_layernorm"),
        (("re:.*vision_model.*mlp\\.fc1",), "re:.*vision_model.*post_attention_layernorm"),
        (("re:.*vision_model.*o_proj",), "re:.*vision_model.*v_proj"),
    ),
    # the decoder's residual stream; the image states reach it only through cross-attention keys and values,
    # which read them, not the stream: the projector stays as it is
    rotation_layout=text_tower_layout("model.language_model", cross_attention=True),
    verified_transformers=TESTED_TRANSFORMERS.releases,
)


#: without an image neither the vision encoder nor the cross-attention layers run
TARGETS_BY_MODALITY = {"mllama": {"text": ("MllamaSelfAttentionDecoderLayer",), "image": MLLAMA.sequential_targets}}


@hookimpl
def layerwise_register_model_patches(register):
    register(MLLAMA)
