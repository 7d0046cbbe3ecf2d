"""Sentence-embedding agreement between a reference encoder and its compressed copy.

Used by the demo, ``layerwise eval`` (encoders, and the encoder of a seq2seq model) and the
benchmarks: mean-pooled embeddings (as sentence-transformers MiniLM models use), their mean cosine
similarity, and how often each sentence's nearest neighbour is the same under both models.
The hidden states pooled are the model's last: ``last_hidden_state`` of a base model, the last of
``hidden_states`` of a model with a task head, the encoder's of an encoder-decoder. Imports only
torch (the benchmarks load this file by path under another Python).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@torch.no_grad()
def sentence_embeddings(model: torch.nn.Module, tokenizer: Any, sentences: list[str],
                        batch_size: int = 64, max_length: int = 128,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """L2-normalised mean-pooled last hidden states, one row per sentence (on the CPU).

    ``device`` is where the inputs go (the model's own device when ``None``). A tokenizer without a
    padding token gets one sentence at a time.
    """
    device = device if device is not None else _device_of(model)
    padding = getattr(tokenizer, "pad_token", None) is not None
    batch_size = batch_size if padding else 1
    rows = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(sentences[i:i + batch_size], padding=padding, truncation=True,
                        max_length=max_length, return_tensors="pt")
        enc = {key: value.to(device) for key, value in enc.items()}
        hidden = last_hidden_state(model, enc)
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        rows.append(torch.nn.functional.normalize(pooled.float(), dim=-1).cpu())
    return torch.cat(rows)


def last_hidden_state(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The last hidden states for ``inputs``: a base model's, a head model's last layer's, or an
    encoder-decoder's encoder's."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return model.get_encoder()(**inputs).last_hidden_state
    if getattr(model, "base_model", model) is model:  # a base model returns its last hidden states
        return model(**inputs).last_hidden_state
    return model(**inputs, output_hidden_states=True).hidden_states[-1]


def _device_of(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


@dataclass(frozen=True)
class EmbeddingAgreement:
    """Mean cosine of the compressed model's embeddings to the original's, and nearest-neighbour agreement."""

    mean_cosine: float
    nearest_neighbour_agreement: float
    sentences: int


def embedding_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> EmbeddingAgreement:
    """Compare two row-aligned, normalised embedding matrices."""
    cosine = (reference * candidate).sum(-1).mean().item()

    def nearest(embeddings: torch.Tensor) -> torch.Tensor:
        similarity = embeddings @ embeddings.T
        similarity.fill_diagonal_(-float("inf"))
        return similarity.argmax(-1)

    agreement = (nearest(reference) == nearest(candidate)).float().mean().item()
    return EmbeddingAgreement(cosine, agreement, reference.shape[0])
