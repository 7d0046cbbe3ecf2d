"""Smoothing mappings found from the layout of Llama-like decoders no patch describes (Qwen2, Mistral), each
proven exact on a tiny twin before use, so AWQ and SmoothQuant run on them; a mapping that is not exact is
dropped, and a model with none says why."""

from __future__ import annotations

import warnings

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization.mappings import MappingError, resolve_mappings
from layerwise.algorithms.quantization.smoothing import apply_smoothing
from layerwise.algorithms.quantization.storage import linear_weight
from layerwise.host.patch_selection import find_patch
from layerwise.testing import token_batches
from layerwise.tracing import smoothing_layout
from layerwise.tracing.smoothing_layout import CANDIDATES, discover_mappings

BATCHES = token_batches(4, 16, vocab=128)


def decoder(family: str, kv_heads: int = 4):
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                                 "mistral": (MistralConfig, MistralForCausalLM)}[family]
    torch.manual_seed(0)
    config = config_class(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=128)
    return model_class(config).eval()


def logits(model):
    with torch.no_grad():
        return model(**BATCHES[0]).logits


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_the_four_llama_mappings_are_found_and_exact_on_the_model_itself(family):
    model = decoder(family)
    assert find_patch(model) is None  # no zoo patch: nothing declares its mappings
    found = discover_mappings(model)
    assert found.mappings == CANDIDATES and not found.dropped
    expected = logits(model)
    generator = torch.Generator().manual_seed(3)
    for mapping in resolve_mappings(model, found.mappings, owner="test").mappings:  # the identity, on the model
        width = linear_weight(model.get_submodule(mapping.balance[0])).shape[1]
        apply_smoothing(model, mapping, torch.rand(width, generator=generator) * 3.9 + 0.1)
    torch.testing.assert_close(logits(model), expected, rtol=1e-5, atol=1e-5)


def test_grouped_query_attention_drops_v_to_o_with_the_reason():
    found = discover_mappings(decoder("qwen2", kv_heads=2))
    assert (("re:.*o_proj",), "re:.*v_proj") not in found.mappings and len(found.mappings) == 3
    (dropped, why), = found.dropped
    assert dropped == (("re:.*o_proj",), "re:.*v_proj") and "grouped-query" in why


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
@pytest.mark.parametrize("recipe", ["AWQ_W4A16_ASYM", "SmoothQuantModifier"])
def test_awq_and_smoothquant_run_on_families_without_a_patch(family, recipe, tmp_path):
    model = decoder(family)
    expected = logits(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layerwise.compress(model, recipe, dataset=BATCHES, show_progress=False,
                           output_dir=tmp_path / "out" if recipe.startswith("AWQ") else None)
    modifier_scales = [m for m in model.layerwise_report.modifiers]
    assert modifier_scales
    if recipe == "SmoothQuantModifier":  # smoothing alone is exact
        torch.testing.assert_close(logits(model), expected, rtol=1e-4, atol=1e-5)
    else:
        from transformers import AutoModelForCausalLM

        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
        got = logits(model)
        torch.testing.assert_close(logits(reloaded), got, rtol=0, atol=1e-5 * got.abs().max().item())


def test_a_candidate_that_is_not_exact_is_dropped_by_the_proof(monkeypatch):
    # the input norm also feeds q/k/v: scaling only gate/up by it changes the outputs, and the twin shows it
    wrong = (("re:.*gate_proj", "re:.*up_proj"), "re:.*input_layernorm")
    monkeypatch.setattr(smoothing_layout, "CANDIDATES", (CANDIDATES[0], wrong))
    monkeypatch.setattr(smoothing_layout, "_PROVEN", {})
    found = discover_mappings(decoder("mistral"))
    assert found.mappings == (CANDIDATES[0],)
    (dropped, why), = found.dropped
    assert dropped == wrong and "changes the tiny twin's outputs" in why


def test_a_model_without_the_layout_names_why_none_was_found():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)).eval()
    with pytest.raises(MappingError) as info:
        layerwise.compress(model, "SmoothQuantModifier", dataset=BATCHES, show_progress=False)
    message = str(info.value)
    assert "none was found from the layout of GPT2LMHeadModel" in message
    assert "the layout has no such modules" in message and "Pass mappings in the recipe" in message
