"""llm-compressor 0.14 recipe fields beyond config_groups: each works as there, or is refused when the recipe is
read, naming the field and what to write instead; typos get the name that was meant."""

from __future__ import annotations

import pytest

from layerwise.errors import RecipeError
from layerwise.host.recipe import parse_recipe
from layerwise.plugin import ForeignFieldWarning


def _error(recipe) -> str:
    with pytest.raises(RecipeError) as info:
        parse_recipe(recipe)
    return str(info.value)


@pytest.mark.parametrize("weights, fragment", [
    ({"num_bit": 4}, "'num_bit' (did you mean 'num_bits'?)"),
    ({"num_bits": 4, "group_sise": 128}, "'group_sise' (did you mean 'group_size'?)"),
    ({"num_bits": 4, "strategy": "groups", "group_size": 128}, "unknown strategy 'groups'; did you mean 'group'?"),
    ({"num_bits": 4, "type": "ints"}, "did you mean 'int'?"),
])
def test_a_typo_in_a_config_groups_args_names_the_field_that_was_meant(weights, fragment):
    message = _error({"QuantizationModifier": {"config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}})
    assert fragment in message and "config_groups.g.weights" in message


def test_a_typo_in_a_config_group_or_a_scheme_mapping_names_the_field_that_was_meant():
    assert "'targts' (did you mean 'targets'?)" in _error(
        {"QuantizationModifier": {"config_groups": {"g": {"targts": ["Linear"], "weights": {"num_bits": 4}}}}})
    assert "'num_bit' (did you mean 'num_bits'?)" in _error({"QuantizationModifier": {"scheme": {"num_bit": 4}}})
    assert "did you mean 'group'?" in _error({"GPTQModifier": {"scheme": "W4A16", "strategy": "groups"}})
    assert "'weight' (did you mean 'weights'?)" in _error(
        {"QuantizationModifier": {"scheme": {"weight": {"num_bits": 4}, "targets": ["Linear"]}}})
    assert "'num_bit' (did you mean 'num_bits'?)" in _error(
        {"QuantizationModifier": {"scheme": None, "kv_cache_scheme": {"num_bit": 8}}})


def test_a_python_modifier_reads_foreign_fields_as_a_recipe_does():
    """GPTQModifier(..., batched_quantization=...) was a bare TypeError; a recipe only warned."""
    from layerwise.plugins.modifiers.gptq import GPTQModifier
    from layerwise.plugins.modifiers.sparsegpt import SparseGPTModifier

    with pytest.warns(ForeignFieldWarning, match=r"^GPTQModifier.batched_quantization is ignored: llm-compressor's"):
        modifier = GPTQModifier(scheme="W4A16", batched_quantization="auto", ignore=["lm_head"])
    assert modifier.args.num_bits == 4 and modifier.ignore == ["lm_head"]
    with pytest.raises(RecipeError, match=r"^GPTQModifier.sequential_targets: an llm-compressor field .* --targets"):
        GPTQModifier(scheme="W4A16", sequential_targets=["LlamaDecoderLayer"])
    with pytest.warns(ForeignFieldWarning, match="preserve_sparsity_mask is ignored"):
        SparseGPTModifier(sparsity=0.5, preserve_sparsity_mask=True)


def test_a_python_modifier_refuses_an_unknown_field_naming_the_one_meant():
    from layerwise.plugins.modifiers.gptq import GPTQModifier
    from layerwise.plugins.modifiers.wanda import WandaModifier

    with pytest.raises(RecipeError, match=r"^GPTQModifier: unknown field\(s\) 'foo' for GPTQModifier; valid fields: "
                                          r"scheme, targets"):
        GPTQModifier(scheme="W4A16", foo=1)
    with pytest.raises(RecipeError, match=r"'dampening' \(did you mean 'dampening_frac'\?\)"):
        GPTQModifier(scheme="W4A16", dampening=0.1)
    with pytest.raises(RecipeError, match=r"'sparsty' \(did you mean 'sparsity'\?\)"):
        WandaModifier(sparsty=0.5)
