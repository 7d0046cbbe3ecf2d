"""Whisper: every encoder layer and every decoder layer calibrated one at a time.

Audio enters as log-mel ``input_features`` ``(batch, num_mel_bins, 2 * max_source_positions)``
(the two stride-2 convolutions halve the frames to ``max_source_positions``); the decoder
needs ``decoder_input_ids`` starting with ``decoder_start_token_id``.
"""

from __future__ import annotations

from typing import Any

import torch

from layerwise import ModelPatch, hookimpl
from layerwise.plugin import TESTED_TRANSFORMERS
from layerwise.plugin.quantization import refused_layout

from . import _inputs, _tiny


def sample_inputs(config: Any, modality: str = "audio", batch: int = 2, seq_len: int = 8) -> dict[str, torch.Tensor]:
    """Random log-mel features for a full window and a short decoder prompt."""
    _inputs.check_modality("Whisper", modality, (_inputs.AUDIO,))
    frames = 2 * config.max_source_positions
    features = _inputs.pixels(batch, config.num_mel_bins, frames)
    seq_len = min(seq_len, config.max_target_positions)
    decoder_input_ids = _inputs.text_ids(config.vocab_size, batch, seq_len, avoid=_inputs.special_ids(config))
    decoder_input_ids[:, 0] = config.decoder_start_token_id
    return {"input_features": features, "decoder_input_ids": decoder_input_ids}


def tiny_whisper() -> torch.nn.Module:
    """A seeded 2 + 2-layer Whisper on 16 mel bins."""
    from transformers import WhisperConfig

    config = WhisperConfig(
        vocab_size=256, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=32,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None)
    return _tiny.seeded("WhisperForConditionalGeneration", config)


WHISPER = ModelPatch(
    name="whisper",
    model_types=("whisper",),
    architectures=("WhisperForConditionalGeneration", "WhisperModel"),
    sequential_targets=("WhisperEncoderLayer", "WhisperDecoderLayer"),
    # proj_out is the (tied) vocabulary head
    ignore=("proj_out",),
    # vLLM caches the decoder's self-attention and its cross-attention (the encoder output's keys and values),
    # never the encoder's attention: only the decoder's get KV-cache scales
    attention_modules=("re:.*decoder\\.layers\\.\\d+\\.self_attn", "re:.*decoder\\.layers\\.\\d+\\.encoder_attn"),
    sample_inputs=sample_inputs,
    tiny_models=(tiny_whisper,),
    # encoder and decoder layers alike. A decoder layer's encoder_attn_layer_norm feeds only the cross-attention's
    # q_proj (k/v read the encoder output); that output (the encoder's last norm) feeds every decoder layer, is
    # cached before any of them runs, and so is not smoothed
    smoothing_mappings=(
        (("re:.*self_attn\\.q_proj", "re:.*self_attn\\.k_proj", "re:.*self_attn\\.v_proj"),
         "re:.*self_attn_layer_norm"),
        (("re:.*encoder_attn\\.q_proj",), "re:.*encoder_attn_layer_norm"),
        (("re:.*fc1",), "re:.*final_layer_norm"),
        (("re:.*self_attn\\.out_proj",), "re:.*self_attn\\.v_proj"),
        (("re:.*encoder_attn\\.out_proj",), "re:.*encoder_attn\\.v_proj"),
    ),
    rotation_layout=refused_layout(
        "its streams are normalised by LayerNorms with a shift (bias): folding the decoder's final layer_norm into "
        "the head puts that shift into proj_out, which has no bias to hold it, and the encoder's stream starts "
        "after a GELU (conv2's), where no rotation can be folded in"),
    verified_transformers=TESTED_TRANSFORMERS.releases,
)


@hookimpl
def layerwise_register_model_patches(register):
    register(WHISPER)
