import pytest

from layerwise.errors import RecipeError, UnknownNameError
from layerwise.recipe import parse_recipe, recipe_to_yaml


def test_preset_name_is_rtn_on_every_linear_but_the_head():
    (modifier,) = parse_recipe("W4A16")
    assert type(modifier).__name__ == "QuantizationModifier"
    assert modifier.scheme == "W4A16"
    assert "lm_head" in modifier.ignore


def test_yaml_text_and_nested_stages_are_read():
    text = """
    quant_stage:
      quant_modifiers:
        QuantizationModifier:
          scheme: W8A16
          ignore: [lm_head]
    """
    (modifier,) = parse_recipe(text)
    assert modifier.scheme == "W8A16"


def test_yaml_file(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("QuantizationModifier:\n  scheme: W4A16_ASYM\n")
    (modifier,) = parse_recipe(str(path))
    assert modifier.scheme == "W4A16_ASYM"


def test_unknown_preset_lists_valid_names():
    with pytest.raises(UnknownNameError) as info:
        parse_recipe("W3A16")
    assert "W4A16" in str(info.value) and "QuantizationModifier" in str(info.value)


def test_unknown_modifier_lists_valid_modifiers():
    with pytest.raises(UnknownNameError) as info:
        parse_recipe({"FancyModifier": {"scheme": "W4A16"}})
    assert "FancyModifier" in str(info.value) and "QuantizationModifier" in str(info.value)


def test_unknown_field_lists_valid_fields():
    with pytest.raises(RecipeError) as info:
        parse_recipe({"QuantizationModifier": {"shceme": "W4A16"}})
    message = str(info.value)
    assert "'shceme'" in message and "scheme" in message.split("valid fields:")[1]


def test_missing_recipe_file_is_named(tmp_path):
    with pytest.raises(RecipeError, match="missing.yaml"):
        parse_recipe(str(tmp_path / "missing.yaml"))


def test_saved_recipe_round_trips():
    modifiers = parse_recipe({"QuantizationModifier": {"scheme": "W8A16", "ignore": ["lm_head", "re:.*gate"]}})
    (again,) = parse_recipe(recipe_to_yaml(modifiers))
    assert again.scheme == "W8A16" and again.ignore == ["lm_head", "re:.*gate"]


def test_algorithm_presets_name_the_modifier_and_scheme():
    (gptq,) = parse_recipe("GPTQ_W4A16")
    assert type(gptq).__name__ == "GPTQModifier" and gptq.scheme == "W4A16" and gptq.requires_data
    (rtn,) = parse_recipe("W8A16")
    assert type(rtn).__name__ == "QuantizationModifier" and not rtn.requires_data
    with pytest.raises(UnknownNameError, match="GPTQ_W4A16_ASYM"):
        parse_recipe("GPTQ_W3A16")
