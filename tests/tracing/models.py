"""Tiny random models (fp32, seeded) and sample inputs for the tracing tests and bench."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers as tf

VOCAB = 96
_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)


def _configs() -> dict[str, Callable[[], Any]]:
    return {
        "LlamaForCausalLM": lambda: tf.LlamaConfig(**_TEXT),
        "MistralForCausalLM": lambda: tf.MistralConfig(**_TEXT, sliding_window=4),
        "Qwen2ForCausalLM": lambda: tf.Qwen2Config(**_TEXT),
        "Qwen3ForCausalLM": lambda: tf.Qwen3Config(**_TEXT, head_dim=8),
        "Qwen3MoeForCausalLM": lambda: tf.Qwen3MoeConfig(**_TEXT, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                                         moe_intermediate_size=16, decoder_sparse_step=1),
        "MixtralForCausalLM": lambda: tf.MixtralConfig(**_TEXT, num_local_experts=4, num_experts_per_tok=2),
        "Gemma2ForCausalLM": lambda: tf.Gemma2Config(**_TEXT, head_dim=8, sliding_window=4),
        "Gemma3ForCausalLM": lambda: tf.Gemma3TextConfig(**_TEXT, head_dim=8, sliding_window=4),
        "Phi3ForCausalLM": lambda: tf.Phi3Config(**_TEXT, pad_token_id=0),
        "GPT2LMHeadModel": lambda: tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64),
        "OPTForCausalLM": lambda: tf.OPTConfig(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                               vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=32,
                                               pad_token_id=1),
        "FalconForCausalLM": lambda: tf.FalconConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                     vocab_size=VOCAB),
        "GPTNeoXForCausalLM": lambda: tf.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                       num_attention_heads=4, vocab_size=VOCAB,
                                                       max_position_embeddings=64),
        "DeepseekV3ForCausalLM": lambda: tf.DeepseekV3Config(
            **{**_TEXT, "num_hidden_layers": 3}, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
            moe_intermediate_size=16, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, n_shared_experts=1),
        "BertModel": lambda: tf.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=64),
        "T5ForConditionalGeneration": lambda: tf.T5Config(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2,
                                                          num_heads=4, d_kv=8, vocab_size=VOCAB),
        "WhisperForConditionalGeneration": lambda: tf.WhisperConfig(
            d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
            encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=16,
            max_target_positions=32, vocab_size=VOCAB, pad_token_id=0, decoder_start_token_id=1),
    }


COVERAGE = list(_configs())


def build(name: str, device: str | torch.device = "cpu", seed: int = 0) -> torch.nn.Module:
    """A tiny ``transformers.<name>`` with random weights (or on meta), eval mode."""
    torch.manual_seed(seed)
    config = _configs()[name]()
    with torch.device(device):
        model = getattr(tf, name)(config)
    return model.eval()


def sample_inputs(model: torch.nn.Module, batch: int = 2, seq: int = 6, seed: int = 1, pad: bool = False) -> dict[str, Any]:
    """Inputs by forward-argument name; ``pad`` left-pads the first row (masks get exercised)."""
    gen = torch.Generator().manual_seed(seed)
    config = model.config
    ids = torch.randint(2, VOCAB, (batch, seq), generator=gen)
    mask = torch.ones(batch, seq, dtype=torch.long)
    if pad:
        mask[0, : seq // 3] = 0
    if config.model_type == "whisper":
        frames = 2 * config.max_source_positions
        return {"input_features": torch.randn(batch, config.num_mel_bins, frames, generator=gen),
                "decoder_input_ids": ids}
    inputs = {"input_ids": ids, "attention_mask": mask}
    if config.is_encoder_decoder:
        inputs["decoder_input_ids"] = torch.randint(2, VOCAB, (batch, max(2, seq - 2)), generator=gen)
    return inputs
