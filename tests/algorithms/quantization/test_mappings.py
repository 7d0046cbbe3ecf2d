"""Smoothing mappings resolved on a model: nearest balance layers, width checks, named errors."""

from __future__ import annotations

import pytest
import torch

from layerwise.algorithms.quantization.mappings import MappingError, resolve_mappings
from layerwise.algorithms.quantization.smoothing import apply_smoothing
from layerwise.model_zoo.llama import LLAMA, tiny_llama

V_TO_O = ((("re:.*o_proj",), "re:.*v_proj"),)


def test_each_norm_pairs_with_the_layers_of_its_own_block():
    resolution = resolve_mappings(tiny_llama(), LLAMA.smoothing_mappings, owner="T", patch_name="llama")
    pairs = {m.smoothed: m.balance for m in resolution.mappings}
    assert pairs["model.layers.1.input_layernorm"] == tuple(f"model.layers.1.self_attn.{p}_proj" for p in "qkv")
    assert pairs["model.layers.0.post_attention_layernorm"] == ("model.layers.0.mlp.gate_proj",
                                                               "model.layers.0.mlp.up_proj")
    assert pairs["model.layers.1.mlp.up_proj"] == ("model.layers.1.mlp.down_proj",)
    assert len(pairs) == 6
    # the tiny Llama has 2 KV heads: its v_proj -> o_proj mapping cannot apply
    assert [name for name, _ in resolution.skipped] == [f"model.layers.{i}.self_attn.v_proj" for i in (0, 1)]


def test_a_block_without_a_match_takes_nothing_from_another_block():
    # layer 0's norm would otherwise reach for layer 1's gate_proj, one scope further out
    mapping = (((r"re:.*layers\.1\.mlp\.gate_proj",), "re:.*post_attention_layernorm"),)
    resolution = resolve_mappings(tiny_llama(), mapping, owner="T")
    assert [m.smoothed for m in resolution.mappings] == ["model.layers.1.post_attention_layernorm"]
    assert resolution.skipped == (("model.layers.0.post_attention_layernorm", "no balance layer near it"),)


def test_a_dense_layer_of_a_moe_model_keeps_to_its_own_mlp():
    from layerwise.host.patch_selection import apply_patch
    from layerwise.model_zoo.deepseek_v3 import DEEPSEEK_V3

    model = apply_patch(DEEPSEEK_V3.tiny_models[0](), DEEPSEEK_V3)  # layer 0 dense, layer 1 routed experts
    mapping = (((r"re:.*mlp\.gate", r"re:.*mlp\.(.*\.)?gate_proj"), "re:.*post_attention_layernorm"),)
    dense, routed = resolve_mappings(model, mapping, owner="T").mappings
    assert dense.balance == ("model.layers.0.mlp.gate_proj",)
    assert routed.balance == ("model.layers.1.mlp.gate", *(f"model.layers.1.mlp.experts.{e}.gate_proj" for e in range(4)),
                              "model.layers.1.mlp.shared_experts.gate_proj")


def test_grouped_query_v_to_o_is_skipped_with_the_reason():
    resolution = resolve_mappings(tiny_llama(), V_TO_O, owner="T")
    assert not resolution.mappings
    assert [why for _, why in resolution.skipped] == [
        f"model.layers.{i}.self_attn.o_proj reads 64 channels, model.layers.{i}.self_attn.v_proj produces 32 "
        f"(e.g. grouped-query v_proj -> o_proj)" for i in (0, 1)]


def test_a_pattern_may_pick_every_expert_of_the_block():
    from layerwise.model_zoo.qwen3_moe import QWEN3_MOE

    model = QWEN3_MOE.tiny_models[0]()
    from layerwise.host.patch_selection import apply_patch

    apply_patch(model, QWEN3_MOE)  # experts unfused into Linear layers
    mapping = ((("re:.*mlp\\.gate", "re:.*experts\\.\\d+\\.gate_proj"), "re:.*post_attention_layernorm"),)
    (first, _) = resolve_mappings(model, mapping, owner="T").mappings
    assert first.balance[0] == "model.layers.0.mlp.gate"  # the router reads the same input: it is balanced too
    assert first.balance[1:] == tuple(f"model.layers.0.mlp.experts.{e}.gate_proj" for e in range(4))


@pytest.mark.parametrize("mappings,patch,message", [
    ((((("re:.*q_prj",), "re:.*input_layernorm"),)), "llama",
     r"SmoothQuantModifier: mapping \['re:.\*q_prj'\] <- 're:.\*input_layernorm' of the model patch 'llama': "
     r"'re:.\*q_prj' match no module of LlamaForCausalLM"),
    ((), "opt", r"no smoothing mappings: the model patch 'opt' declares no smoothing_mappings. Pass mappings"),
    ((), None, r"no smoothing mappings: no model patch matches this model"),
    (((("re:.*q_proj",),),), None, r"a mapping is \[\[balance patterns...\], smoothed pattern\]"),
])
def test_bad_mappings_are_named_errors(mappings, patch, message):
    with pytest.raises(MappingError, match=message):
        resolve_mappings(tiny_llama(), mappings, owner="SmoothQuantModifier", patch_name=patch)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_smoothing_any_positive_scales_keeps_the_function(family):
    # Llama's RMSNorm scales by w, Gemma's by 1 + w: both are folded exactly
    from layerwise.model_zoo.gemma3 import tiny_gemma3_text

    model = tiny_llama() if family == "llama" else tiny_gemma3_text()
    # Gemma norms the attention output with post_attention_layernorm; its MLP reads pre_feedforward_layernorm
    mlp_norm = "re:.*post_attention_layernorm" if family == "llama" else "re:.*pre_feedforward_layernorm"
    norms = ((("re:.*q_proj", "re:.*k_proj", "re:.*v_proj"), "re:.*input_layernorm"),
             (("re:.*gate_proj", "re:.*up_proj"), mlp_norm))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    before = _logits(model, ids)
    generator = torch.Generator().manual_seed(4)
    for mapping in resolve_mappings(model, norms, owner="T").mappings:
        width = model.get_submodule(mapping.balance[0]).in_features
        apply_smoothing(model, mapping, torch.rand(width, generator=generator) * 4 + 0.1)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-5, atol=1e-5)


def test_bad_scales_are_refused():
    model = tiny_llama()
    (mapping, *_) = resolve_mappings(model, LLAMA.smoothing_mappings, owner="T").mappings
    with pytest.raises(ValueError, match="finite and positive"):
        apply_smoothing(model, mapping, torch.zeros(64))
    with pytest.raises(ValueError, match="produces 64 channels"):
        apply_smoothing(model, mapping, torch.ones(32))


# -- the forms a recipe writes -----------------------------------------------------------------------
QKV = ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]


@pytest.mark.parametrize("mapping", [
    {"smooth_layer": "re:.*input_layernorm$", "balance_layers": QKV},  # llm-compressor's AWQ form
    {"smooth_layer": "re:.*input_layernorm$", "balance_layers": QKV, "activation_hook_target": None},
    {"balance_layers": QKV, "smooth_layers": "re:.*input_layernorm$"},  # SmoothQuant's LayerMap keys
    [QKV, "re:.*input_layernorm$"],
])
def test_llm_compressors_keyed_mapping_reads_as_the_pair(mapping):
    """It used to be unpacked as its two key names, which then matched no module."""
    from layerwise.algorithms.quantization.mappings import recipe_mappings

    assert recipe_mappings([mapping], "AWQModifier") == [[QKV, "re:.*input_layernorm$"]]
    resolution = resolve_mappings(tiny_llama(), recipe_mappings([mapping], "T"), owner="T")
    assert [m.smoothed for m in resolution.mappings] == [f"model.layers.{i}.input_layernorm" for i in (0, 1)]


def test_an_awq_mapping_object_reads_as_the_pair():
    from dataclasses import dataclass

    from layerwise.algorithms.quantization.mappings import recipe_mappings

    @dataclass
    class AWQMapping:  # llm-compressor's, as its scripts build them
        smooth_layer: str
        balance_layers: list[str]
        activation_hook_target: str | None = None

    assert recipe_mappings([AWQMapping("re:.*up_proj$", ["re:.*down_proj$"])], "T") == [
        [["re:.*down_proj$"], "re:.*up_proj$"]]


def test_an_activation_hook_target_layerwise_cannot_honour_is_refused_with_the_fix():
    from layerwise.algorithms.quantization.mappings import recipe_mappings

    with pytest.raises(MappingError, match="activation_hook_target 'mlp' cannot be honoured: layerwise samples the "
                                           "input of the mapping's first balance layer. List first"):
        recipe_mappings([{"smooth_layer": "re:.*input_layernorm$", "balance_layers": QKV,
                          "activation_hook_target": "mlp"}], "AWQModifier")


@pytest.mark.parametrize("mapping, fragment", [
    ({"smooth_layr": "re:.*input_layernorm$", "balance_layers": QKV}, "unknown key.*'smooth_layr'.*'smooth_layer'"),
    ({"smooth_layer": "re:.*input_layernorm$"}, "got"),
    (["re:.*q_proj"], "got"),
    ("re:.*q_proj", "got"),
    ([QKV, "re:.*input_layernorm$", "extra"], "got"),
])
def test_a_malformed_mapping_is_an_error_showing_both_forms(mapping, fragment):
    from layerwise.algorithms.quantization.mappings import recipe_mappings

    with pytest.raises(MappingError, match=fragment) as info:
        recipe_mappings([mapping], "AWQModifier")
    assert "[[balance patterns...], smoothed pattern]" in str(info.value)
    assert "{smooth_layer: smoothed pattern, balance_layers: [balance patterns...]}" in str(info.value)
