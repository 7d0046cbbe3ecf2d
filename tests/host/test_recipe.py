import pytest

from layerwise.errors import RecipeError, UnknownNameError
from layerwise.host.recipe import parse_recipe, recipe_to_yaml


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
        parse_recipe("W5A16")
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
        parse_recipe("GPTQ_W5A16")


@pytest.mark.parametrize(("recipe", "named", "meant"), [
    # a misspelt modifier beside a right one in an llm-compressor-style stage: never dropped silently
    ({"quant_stage": {"quant_modifiers": {"QuantizationModifier": {"scheme": "W8A16"},
                                          "GPTQmodifier": {"scheme": "W4A16"}}}},
     "recipe.quant_stage.quant_modifiers.GPTQmodifier", "GPTQModifier"),
    ({"stage": {"modifiers": {"QuantisationModifer": {"scheme": "W8A16"}}}},
     "recipe.stage.modifiers.QuantisationModifer", "QuantizationModifier"),
    ({"stage": {"GPTQModifer": None}}, "recipe.stage.GPTQModifer", "GPTQModifier"),
    ({"verison": 1, "GPTQModifier": {}}, "recipe.verison", "version"),
])
def test_unknown_keys_at_any_depth_name_where_and_what_was_meant(recipe, named, meant):
    with pytest.raises(RecipeError) as info:
        parse_recipe(recipe)
    assert isinstance(info.value, UnknownNameError)
    assert f"(at {named}" in str(info.value) and f"did you mean {meant!r}?" in str(info.value)


def test_a_mapping_of_fields_under_an_unregistered_name_is_an_unknown_modifier():
    with pytest.raises(RecipeError, match=r"unknown modifier 'Foo'.*valid modifiers: .*GPTQModifier"):
        parse_recipe({"stage": {"Foo": {"scheme": "W4A16"}}})


def test_stages_groups_lists_and_metadata_keys_still_parse():
    recipe = {"version": "1.0", "quant_stage": {"run_type": "oneshot", "gptq_modifiers": [
        {"GPTQModifier": {"scheme": "W4A16"}}, {"QuantizationModifier": {"scheme": "W8A16"}}]}}
    assert [type(m).__name__ for m in parse_recipe(recipe)] == ["GPTQModifier", "QuantizationModifier"]


def test_a_plain_value_in_a_list_of_modifiers_is_named_by_index():
    with pytest.raises(RecipeError, match=r"recipe.s.modifiers\[1\]: 'QuantizationModifier' is not a mapping"):
        parse_recipe({"s": {"modifiers": [{"GPTQModifier": {}}, "QuantizationModifier"]}})


def test_unknown_fields_get_the_field_that_was_meant():
    with pytest.raises(RecipeError, match=r"'blocksize' \(did you mean 'block_size'\?\)"):
        parse_recipe({"GPTQModifier": {"blocksize": 64}})


def _plugin_with(*classes):
    import types

    from layerwise.plugin import hookimpl

    class Plugin:
        @hookimpl
        def layerwise_register_modifiers(self, register):
            for cls in classes:
                register(cls.__name__, cls)

    return types.SimpleNamespace(plugin=Plugin())


def test_a_plugin_modifier_brings_its_own_algorithm_and_chained_presets(register_plugin):
    import dataclasses
    from typing import ClassVar

    from layerwise.host.recipe import parse_recipe, preset_names
    from layerwise.plugin import Modifier

    @dataclasses.dataclass
    class RoundTwiceModifier(Modifier):
        preset_prefix: ClassVar[str | None] = "TWICE"
        chained_presets: ClassVar[dict] = {"TWICE_THEN_GPTQ": (("RoundTwiceModifier", {"scheme": "W8A16"}),
                                                               ("GPTQModifier", {"scheme": "W4A16"}))}
        scheme: str = "W4A16"

    assert "TWICE_W8A16" not in preset_names()
    register_plugin(_plugin_with(RoundTwiceModifier).plugin, "twice")
    assert "TWICE_W8A16" in preset_names() and "TWICE_THEN_GPTQ" in preset_names()
    [built] = parse_recipe("TWICE_W8A16")
    assert isinstance(built, RoundTwiceModifier) and built.scheme == "W8A16"
    first, second = parse_recipe("TWICE_THEN_GPTQ")
    assert (type(first).__name__, type(second).__name__) == ("RoundTwiceModifier", "GPTQModifier")


def test_two_modifiers_claiming_one_preset_prefix_is_an_error_naming_both(register_plugin):
    import dataclasses
    from typing import ClassVar

    from layerwise.errors import PluginError
    from layerwise.host.recipe import parse_recipe
    from layerwise.plugin import Modifier

    @dataclasses.dataclass
    class OtherGPTQModifier(Modifier):
        preset_prefix: ClassVar[str | None] = "GPTQ"

    register_plugin(_plugin_with(OtherGPTQModifier).plugin, "other-gptq")
    with pytest.raises(PluginError, match="'GPTQModifier' and 'OtherGPTQModifier' both declare .* 'GPTQ'"):
        parse_recipe("GPTQ_W4A16")
