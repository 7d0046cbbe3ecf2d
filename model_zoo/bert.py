"""BERT family (BERT, MiniLM, RoBERTa-style encoders): calibrate one BertLayer at a time."""

from __future__ import annotations

from typing import Any

import torch

from layerwise import ModelPatch, hookimpl
from layerwise.plugin import TESTED_TRANSFORMERS
from layerwise.plugin.quantization import refused_layout

from . import _tiny


def sample_inputs(config: Any, modality: str = "text", batch: int = 2, seq_len: int = 16) -> dict[str, torch.Tensor]:
    """Random token ids and a full attention mask; BERT takes text only."""
    if modality != "text":
        raise ValueError(f"BERT models take text only, not {modality!r}")
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids),
            "token_type_ids": torch.zeros_like(input_ids)}


def _tiny_config() -> Any:
    from transformers import BertConfig

    return BertConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64)


def tiny_bert() -> torch.nn.Module:
    """A seeded 2-layer BERT encoder (MiniLM's layout, smaller)."""
    return _tiny.seeded("BertModel", _tiny_config())


def tiny_bert_masked_lm() -> torch.nn.Module:
    """The same encoder under its masked-LM head (``cls.*``)."""
    return _tiny.seeded("BertForMaskedLM", _tiny_config())


def tiny_bert_classifier() -> torch.nn.Module:
    """The same encoder under a sequence-classification head (``classifier``)."""
    return _tiny.seeded("BertForSequenceClassification", _tiny_config())


BERT = ModelPatch(
    name="bert",
    model_types=("bert",),
    architectures=("BertModel", "BertForMaskedLM", "BertForSequenceClassification"),
    sequential_targets=("BertLayer",),
    # the pooler and task heads are tiny and sensitive; embeddings are not Linear
    ignore=("re:.*pooler.*", "re:cls\\..*", "classifier"),
    sample_inputs=sample_inputs,
    tiny_models=(tiny_bert, tiny_bert_masked_lm, tiny_bert_classifier),
    # BERT norms after the residual add (post-LN): a LayerNorm's output is the residual stream itself, so
    # no norm can be smoothed (the residual would change too). Attention values -> output projection can.
    smoothing_mappings=((("re:.*attention\\.output\\.dense",), "re:.*attention\\.self\\.value"),),
    rotation_layout=refused_layout(
        "it normalises after the residual add (post-LN): the stream carried from block to block is a LayerNorm's "
        "output, scaled per channel and shifted, and a rotation of the stream cannot pass through that per-channel "
        "weight"),
    verified_transformers=TESTED_TRANSFORMERS.releases,
)


@hookimpl
def layerwise_register_model_patches(register):
    register(BERT)
