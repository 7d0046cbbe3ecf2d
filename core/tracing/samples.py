"""Small random sample inputs built from a config, for tracing without any dataset."""

from __future__ import annotations

from typing import Any

import torch


def default_modality(config: Any) -> str:
    """``audio`` for speech models, ``image`` for pure vision models, else ``text``."""
    if hasattr(config, "num_mel_bins"):
        return "audio"
    if getattr(config, "vocab_size", None) is None and hasattr(config, "image_size"):
        return "image"
    return "text"


def sample_inputs(config: Any, modality: str | None = None, batch: int = 1, seq: int = 8, seed: int = 0) -> dict[str, Any]:
    """Inputs by forward-argument name (``input_ids``/``attention_mask``, ``decoder_input_ids``
    for encoder-decoders, ``input_features`` for audio, ``pixel_values`` for images)."""
    modality = modality or default_modality(config)
    gen = torch.Generator().manual_seed(seed)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text_config, "vocab_size", None) or 100)
    ids = torch.randint(min(4, vocab - 1), vocab, (batch, seq), generator=gen)
    if modality == "audio":
        frames = 2 * int(getattr(config, "max_source_positions", 1500))
        return {"input_features": torch.randn(batch, config.num_mel_bins, frames, generator=gen),
                "decoder_input_ids": ids[:, :4]}
    if modality == "image":
        vision = getattr(config, "vision_config", config)
        size = int(getattr(vision, "image_size", 224))
        channels = int(getattr(vision, "num_channels", 3))
        inputs: dict[str, Any] = {"pixel_values": torch.randn(batch, channels, size, size, generator=gen)}
        if vision is not config:
            inputs.update(input_ids=ids, attention_mask=torch.ones_like(ids))
        return inputs
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = ids[:, : max(2, seq // 2)]
    return inputs
