"""Sentence-embedding agreement between a reference encoder and its compressed copy.

Used by the demo and the benchmarks: mean-pooled embeddings (as sentence-transformers
MiniLM models use), their mean cosine similarity, and how often each sentence's
nearest neighbour is the same under both models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@torch.no_grad()
def sentence_embeddings(model: torch.nn.Module, tokenizer: Any, sentences: list[str],
                        batch_size: int = 64, max_length: int = 128) -> torch.Tensor:
    """L2-normalised mean-pooled last hidden states, one row per sentence."""
    rows = []
    for i in range(0, len(sentences), batch_size):
        enc = tokenizer(sentences[i:i + batch_size], padding=True, truncation=True,
                        max_length=max_length, return_tensors="pt")
        hidden = model(**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        rows.append(torch.nn.functional.normalize(pooled.float(), dim=-1))
    return torch.cat(rows)


@dataclass(frozen=True)
class EmbeddingAgreement:
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
