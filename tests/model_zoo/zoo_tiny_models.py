"""Tiny seeded fp32 models, one per zoo architecture, built from config classes (no downloads).

``ARCHS[name]`` gives the builder, the zoo module holding its patch, the expected patch name
and the modalities its ``sample_inputs`` supports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=False)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)


def _seeded(cls, config, seed: int = 0):
    torch.manual_seed(seed)
    return cls(config).eval()


def qwen2_vl():
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    return _seeded(Qwen2VLForConditionalGeneration, config)


def qwen2_5_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
                           fullatt_block_indexes=[1]),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
    return _seeded(Qwen2_5_VLForConditionalGeneration, config)


def mllama():
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    config = MllamaConfig(
        vision_config=dict(hidden_size=32, attention_heads=2, num_hidden_layers=2, num_global_layers=1,
                           intermediate_size=64, image_size=28, patch_size=14, max_num_tiles=2,
                           supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]], intermediate_layers_indices=[0],
                           vision_output_dim=64),
        text_config=dict(TEXT, num_hidden_layers=3, cross_attention_layers=[1], bos_token_id=1,
                         eos_token_id=2, pad_token_id=0),
        image_token_index=250)
    return _seeded(MllamaForConditionalGeneration, config)


def llava():
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        vision_config=dict(VISION, model_type="clip_vision_model", image_size=28, patch_size=14,
                           projection_dim=32),
        text_config=dict(TEXT, model_type="llama"),
        image_token_index=250, image_seq_length=4, vision_feature_layer=-1)
    return _seeded(LlavaForConditionalGeneration, config)


def pixtral():
    """Pixtral-12B's layout: a Llava model with a Pixtral vision tower and a Mistral decoder."""
    from transformers import LlavaConfig, LlavaForConditionalGeneration

    config = LlavaConfig(
        vision_config=dict(VISION, model_type="pixtral", image_size=56, patch_size=14, head_dim=16),
        text_config=dict(TEXT, model_type="mistral", head_dim=16),
        image_token_index=250, vision_feature_select_strategy="full", vision_feature_layer=-1)
    return _seeded(LlavaForConditionalGeneration, config)


def mistral3():
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        vision_config=dict(VISION, model_type="pixtral", image_size=56, patch_size=14, head_dim=16),
        text_config=dict(TEXT, model_type="mistral", head_dim=16),
        image_token_index=250, spatial_merge_size=2, vision_feature_layer=-1, tie_word_embeddings=False)
    return _seeded(Mistral3ForConditionalGeneration, config)


def idefics3():
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(
        vision_config=dict(VISION, image_size=56, patch_size=14),
        text_config=dict(TEXT, model_type="llama", pad_token_id=0),
        image_token_id=250, scale_factor=2)
    return _seeded(Idefics3ForConditionalGeneration, config)


def gemma3():
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        vision_config=dict(VISION, model_type="siglip_vision_model", image_size=56, patch_size=14),
        text_config=dict(TEXT, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"]),
        mm_tokens_per_image=4, boi_token_index=251, eoi_token_index=252, image_token_index=250,
        tie_word_embeddings=False)
    return _seeded(Gemma3ForConditionalGeneration, config)


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=256, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=32,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=3, suppress_tokens=None, begin_suppress_tokens=None)
    return _seeded(WhisperForConditionalGeneration, config)


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**dict(TEXT, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                   num_experts_per_tok=2, norm_topk_prob=True))
    return _seeded(Qwen3MoeForCausalLM, config)


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**dict(TEXT, head_dim=16, num_local_experts=4, num_experts_per_tok=2))
    return _seeded(MixtralForCausalLM, config)


def deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(**dict(
        TEXT, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, rope_interleave=False))
    model = _seeded(DeepseekV3ForCausalLM, config)
    # fresh routers start at zero weight: give them random weights so routing actually varies
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


@dataclass(frozen=True)
class Arch:
    build: Callable[[], Any]
    module: str           # model_zoo module name
    patch: str            # expected patch name
    modalities: tuple[str, ...]


ARCHS: dict[str, Arch] = {
    "qwen2_vl": Arch(qwen2_vl, "qwen2_vl", "qwen2_vl", ("text", "image")),
    "qwen2_5_vl": Arch(qwen2_5_vl, "qwen2_vl", "qwen2_5_vl", ("text", "image")),
    "mllama": Arch(mllama, "mllama", "mllama", ("text", "image")),
    "llava": Arch(llava, "llava", "llava", ("text", "image")),
    "pixtral": Arch(pixtral, "llava", "llava", ("text", "image")),
    "mistral3": Arch(mistral3, "llava", "mistral3", ("text", "image")),
    "idefics3": Arch(idefics3, "idefics3", "idefics3", ("text", "image")),
    "gemma3": Arch(gemma3, "gemma3", "gemma3", ("text", "image")),
    "whisper": Arch(whisper, "whisper", "whisper", ("audio",)),
    "qwen3_moe": Arch(qwen3_moe, "qwen3_moe", "qwen3_moe", ("text",)),
    "mixtral": Arch(mixtral, "mixtral", "mixtral", ("text",)),
    "deepseek_v3": Arch(deepseek_v3, "deepseek_v3", "deepseek_v3", ("text",)),
}
