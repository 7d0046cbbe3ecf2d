"""Qwen2-VL and Qwen2.5-VL: every vision block and every decoder layer calibrated one at a time.

Images enter as flattened patches: ``pixel_values`` is ``(sum of t*h*w over images,
channels * temporal_patch * patch * patch)`` with ``image_grid_thw`` giving ``(t, h, w)`` in
patches per image; the merger folds ``spatial_merge_size**2`` patches into one text-side
image token, so an image contributes ``t*h*w / merge**2`` ``<|image_pad|>`` tokens, framed by
``<|vision_start|>`` / ``<|vision_end|>``. ``mm_token_type_ids`` (1 on image tokens) lets the
model build its 3-D M-RoPE positions.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from layerwise import ModelPatch, hookimpl
from layerwise.plugin import TESTED_TRANSFORMERS, LazyFunctions

from . import _inputs, _tiny
from ._rotation import text_tower_layout

IMAGE_SIDE_PATCHES = 4  # a 56x56 image at patch 14: a 4x4 patch grid, 4 tokens after a 2x2 merge


def sample_inputs(config: Any, modality: str = "text", batch: int = 2, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Text ids, or one small image per row with its placeholder run, grid and token types."""
    _inputs.check_modality("Qwen2-VL", modality, (_inputs.TEXT, _inputs.IMAGE))
    text = config.text_config
    avoid = _inputs.special_ids(config, text)
    if modality == _inputs.TEXT:
        return _inputs.text_inputs(text.vocab_size, batch, seq_len, avoid=avoid)

    vision = config.vision_config
    merge = vision.spatial_merge_size
    t, h, w = 1, IMAGE_SIDE_PATCHES, IMAGE_SIDE_PATCHES
    n_tokens = t * h * w // merge**2
    run = [config.vision_start_token_id, *[config.image_token_id] * n_tokens, config.vision_end_token_id]
    input_ids = _inputs.image_prompt(text.vocab_size, run, batch, avoid=avoid)
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    pixel_values = _inputs.pixels(batch * t * h * w, patch_dim)
    mm_token_type_ids = (input_ids == config.image_token_id).int()
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
        "image_grid_thw": torch.tensor([[t, h, w]] * batch),
        "mm_token_type_ids": mm_token_type_ids,
    }


def _opaque_functions(modeling: str) -> tuple:
    """Helpers whose Python loops read tensor values (grids, cu_seqlens), as far as ``modeling`` calls them."""
    import importlib

    from transformers import vision_utils
    from transformers.utils import generic

    names = ("get_vision_position_ids", "get_vision_attention_seqlens", "get_vision_window_index")
    found = [getattr(vision_utils, n) for n in names if hasattr(vision_utils, n)]
    if hasattr(generic, "get_max_seqlen"):
        found.append(generic.get_max_seqlen)
    used = vars(importlib.import_module(f"transformers.models.{modeling}.modeling_{modeling}")).values()
    return tuple(f for f in found if any(f is value for value in used))


_IGNORE = ("lm_head", "re:.*visual\\.merger.*")
# compute_3d_position_ids (M-RoPE positions via itertools.groupby over token types) and
# get_placeholder_mask are methods: the tracer's autowrap turns their call statements into
# opaque calls by itself, so they need no entry here

_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
_SPECIAL = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)


def tiny_qwen2_vl() -> torch.nn.Module:
    """A seeded Qwen2-VL: 2 vision blocks, 2 decoder layers, M-RoPE."""
    from transformers import Qwen2VLConfig

    config = Qwen2VLConfig(
        text_config=dict(_tiny.TEXT, rope_parameters=_MROPE),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2), **_SPECIAL)
    return _tiny.seeded("Qwen2VLForConditionalGeneration", config)


def tiny_qwen2_5_vl() -> torch.nn.Module:
    """A seeded Qwen2.5-VL with windowed and full vision attention."""
    from transformers import Qwen2_5_VLConfig

    config = Qwen2_5_VLConfig(
        text_config=dict(_tiny.TEXT, rope_parameters=_MROPE),
        vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]), **_SPECIAL)
    return _tiny.seeded("Qwen2_5_VLForConditionalGeneration", config)


QWEN2_VL = ModelPatch(
    name="qwen2_vl",
    model_types=("qwen2_vl",),
    architectures=("Qwen2VLForConditionalGeneration", "Qwen2VLModel"),
    sequential_targets=("Qwen2VLVisionBlock", "Qwen2VLDecoderLayer"),
    ignore=_IGNORE,
    # the KV cache is the text decoder's (the vision blocks' fused-qkv attention caches nothing)
    attention_modules=("re:.*language_model\\.layers\\.\\d+\\.self_attn",),
    opaque_functions=LazyFunctions(functools.partial(_opaque_functions, "qwen2_vl")),
    sample_inputs=sample_inputs,
    tiny_models=(tiny_qwen2_vl,),
    smoothing_mappings=(
        (("re:.*language_model.*q_proj", "re:.*language_model.*k_proj", "re:.*language_model.*v_proj"),
         "re:.*language_model.*input_layernorm"),
        (("re:.*language_model.*gate_proj", "re:.*language_model.*up_proj"),
         "re:.*language_model.*post_attention_layernorm"),
        (("re:.*language_model.*o_proj",), "re:.*language_model.*v_proj"),
        # vision blocks: norm1 feeds the fused qkv, norm2 the MLP (Qwen2-VL's fc1, Qwen2.5-VL's gate/up)
        (("re:.*visual\\.blocks\\.\\d+\\.attn\\.qkv",), "re:.*visual\\.blocks\\.\\d+\\.norm1"),
        (("re:.*visual\\.blocks\\.\\d+\\.mlp\\.(fc1|gate_proj|up_proj)",), "re:.*visual\\.blocks\\.\\d+\\.norm2"),
    ),
    # the decoder's residual stream, the merger's last Linear writing the image tokens' embeddings into it
    rotation_layout=text_tower_layout("model.language_model", projector="model.visual.merger.mlp.2"),
    # before 5.23 the image path keeps rope_deltas as module state, which a trace cannot return
    verified_transformers=TESTED_TRANSFORMERS.since("5.23.0"),
)

# the same model one release later: only the class names change
QWEN2_5_VL = dataclasses.replace(
    QWEN2_VL, name="qwen2_5_vl", model_types=("qwen2_5_vl",),
    architectures=("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLModel"),
    sequential_targets=("Qwen2_5_VLVisionBlock", "Qwen2_5_VLDecoderLayer"),
    opaque_functions=LazyFunctions(functools.partial(_opaque_functions, "qwen2_5_vl")), tiny_models=(tiny_qwen2_5_vl,))


#: text-only calibration never runs the vision tower: its blocks are targets only with images
TARGETS_BY_MODALITY = {
    "qwen2_vl": {"text": ("Qwen2VLDecoderLayer",), "image": QWEN2_VL.sequential_targets},
    "qwen2_5_vl": {"text": ("Qwen2_5_VLDecoderLayer",), "image": QWEN2_5_VL.sequential_targets},
}


@hookimpl
def layerwise_register_model_patches(register):
    register(QWEN2_VL)
    register(QWEN2_5_VL)
