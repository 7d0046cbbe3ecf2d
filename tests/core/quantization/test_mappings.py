"""Smoothing mappings resolved on a model: nearest balance layers, width checks, named errors."""

from __future__ import annotations

import pytest

from layerwise.model_zoo.llama import LLAMA, tiny_llama
from layerwise.quantization.mappings import MappingError, resolve_mappings

V_TO_O = ((("re:.*o_proj",), "re:.*v_proj"),)


def test_each_norm_pairs_with_the_layers_of_its_own_block():
    resolution = resolve_mappings(tiny_llama(), LLAMA.smoothing_mappings, owner="T", patch_name="llama")
    pairs = {m.smoothed: m.balance for m in resolution.mappings}
    assert pairs["model.layers.1.input_layernorm"] == tuple(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")
    assert pairs["model.layers.0.post_attention_layernorm"] == ("model.layers.0.mlp.gate_proj",
                                                               "model.layers.0.mlp.up_proj")
    assert len(pairs) == 4 and not resolution.skipped


def test_grouped_query_v_to_o_is_skipped_with_the_reason():
    resolution = resolve_mappings(tiny_llama(), V_TO_O, owner="T")
    assert not resolution.mappings
    assert [why for _, why in resolution.skipped] == [
        f"model.layers.{i}.self_attn.o_proj reads 64 channels, model.layers.{i}.self_attn.v_proj produces 32 "
        f"(e.g. grouped-query v_proj -> o_proj)" for i in (0, 1)]


def test_ignored_balance_layers_leave_the_mapping():
    resolution = resolve_mappings(tiny_llama(), LLAMA.smoothing_mappings, owner="T", ignore=["re:.*k_proj"])
    assert resolution.mappings[0].balance == ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj")


@pytest.mark.parametrize("mappings,patch,message", [
    ((((("re:.*q_prj",), "re:.*input_layernorm"),)), "llama",
     r"SmoothQuantModifier: mapping \['re:.\*q_prj'\] <- 're:.\*input_layernorm' of the model patch 'llama': "
     r"'re:.\*q_prj' match no module of LlamaForCausalLM"),
    ((), "bert", r"no smoothing mappings: the model patch 'bert' declares no smoothing_mappings. Pass mappings"),
    ((), None, r"no smoothing mappings: no model patch matches this model"),
    (((("re:.*q_proj",),),), None, r"a mapping is \[\[balance patterns...\], smoothed pattern\]"),
])
def test_bad_mappings_are_named_errors(mappings, patch, message):
    with pytest.raises(MappingError, match=message):
        resolve_mappings(tiny_llama(), mappings, owner="SmoothQuantModifier", patch_name=patch)
