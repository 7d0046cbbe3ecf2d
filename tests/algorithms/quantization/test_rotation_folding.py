"""Residual-stream rotations: orthogonal matrices, norms folded, the model's function unchanged."""

from __future__ import annotations

import pytest
import torch

from layerwise.algorithms.quantization.rotation import (
    LLAMA_LIKE,
    RotationError,
    check_rms_norm,
    rotate_residual_stream,
    rotation_matrix,
)
from layerwise.plugin import apply_patch, registry

ROTATED_FAMILIES = sorted(name for name, patch in registry("model_patches").items()
                          if patch.rotation_layout and not patch.rotation_layout.refusal)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("kind,size", [("hadamard", 64), ("hadamard", 384), ("orthogonal", 48)])
def test_rotations_are_orthogonal_and_seeded(kind, size):
    q = rotation_matrix(size, kind, seed=5)
    torch.testing.assert_close(q @ q.t(), torch.eye(size, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(q, rotation_matrix(size, kind, seed=5)) and not torch.equal(q, rotation_matrix(size, kind, 6))
    if kind == "hadamard":  # every entry +-1/sqrt(n): no channel dominates
        torch.testing.assert_close(q.abs(), torch.full_like(q, size ** -0.5))


def test_unknown_sizes_and_kinds_are_named():
    with pytest.raises(RotationError, match="use rotation: orthogonal"):
        rotation_matrix(22, "hadamard")
    with pytest.raises(RotationError, match="valid rotations: hadamard, orthogonal"):
        rotation_matrix(16, "givens")


def test_declared_families_exist():
    assert {"llama", "mixtral", "qwen3_moe", "deepseek_v3", "llava", "mistral3", "qwen2_vl", "qwen2_5_vl", "idefics3",
            "mllama"} <= set(ROTATED_FAMILIES)


@pytest.mark.parametrize("family", ROTATED_FAMILIES)
@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
def test_rotating_each_declared_family_keeps_its_function(family, kind):
    patch = registry("model_patches").get(family)
    for build in patch.tiny_models:
        model = apply_patch(build(), patch)
        for norm in (m for n, m in model.named_modules() if n.endswith("norm")):  # norms that are not all ones
            norm.weight.data.uniform_(0.5, 1.5)
        vocab = model.config.get_text_config().vocab_size
        ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(3))
        before = _logits(model, ids)
        embed_before = model.get_input_embeddings().weight.detach().clone()
        resolved = rotate_residual_stream(model, patch.rotation_layout, kind, seed=1)
        torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
        assert resolved.writers and resolved.readers and resolved.norms
        assert all(torch.equal(model.get_submodule(m.smoothed).weight, torch.ones_like(
            model.get_submodule(m.smoothed).weight)) for m in resolved.norms)
        assert not torch.allclose(model.get_input_embeddings().weight, embed_before)  # it did rotate


def test_a_tied_lm_head_is_untied_and_the_config_says_so():
    from tests.conftest import build_tiny_llama

    model = build_tiny_llama(tie_word_embeddings=True)
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    rotate_residual_stream(model, LLAMA_LIKE)
    assert model.lm_head.weight is not model.model.embed_tokens.weight and not model.config.tie_word_embeddings
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)


class _OffsetNorm(torch.nn.Module):
    """Gemma-style: scales by 1 + w."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


def test_norms_that_cannot_be_rotated_through_are_refused():
    with pytest.raises(RotationError, match="does not commute with rotations"):
        check_rms_norm("ln", torch.nn.LayerNorm(16, bias=False), 16)
    with pytest.raises(RotationError, match="no bias"):
        check_rms_norm("ln", torch.nn.LayerNorm(16), 16)
    with pytest.raises(RotationError, match="weight offset"):
        check_rms_norm("norm", _OffsetNorm(16), 16)


def test_a_layout_that_does_not_fit_is_an_error_naming_the_patterns():
    from layerwise.model_zoo.bert import tiny_bert

    with pytest.raises(RotationError, match="embed_tokens"):
        rotate_residual_stream(tiny_bert(), LLAMA_LIKE)
