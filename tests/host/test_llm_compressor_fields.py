"""llm-compressor 0.14 recipe fields beyond config_groups: each works as there, or is refused when the recipe is
read, naming the field and what to write instead; typos get the name that was meant."""

from __future__ import annotations

import pytest

from layerwise.errors import RecipeError
from layerwise.host.recipe import parse_recipe, recipe_to_yaml
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


@pytest.mark.parametrize("fields", [{"weight_observer": "mse"}, {"weight_observer": "memoryless_mse"},
                                    {"observer": {"weights": "mse"}}, {"observer": "memoryless_mse"}])
def test_llm_compressors_weight_observer_fields_choose_layerwise_s_observer(fields):
    """weight_observer and the observer mapping were unknown fields; observer: memoryless_mse failed mid-run."""
    (modifier,) = parse_recipe({"GPTQModifier": {"scheme": "W4A16", **fields}})
    assert modifier.args.observer == "mse"


def test_a_python_modifier_takes_weight_observer_too():
    from layerwise.plugins.modifiers.gptq import GPTQModifier

    assert GPTQModifier(scheme="W4A16", weight_observer="mse").args.observer == "mse"
    with pytest.raises(RecipeError, match="weight_observer and observer are one setting"):
        GPTQModifier(scheme="W4A16", weight_observer="mse", observer="minmax")


@pytest.mark.parametrize("fields, expected", [
    ({"input_observer": "minmax"}, "moving_average_minmax"),  # llm-compressor's minmax: a moving average
    ({"input_observer": "static_minmax"}, "minmax"),  # the widest range seen: layerwise's minmax
    ({"observer": {"weights": "mse", "input": "mse"}}, "mse"),
])
def test_the_input_observer_calibrates_static_input_scales_as_llm_compressor_s_does(fields, expected):
    (modifier,) = parse_recipe({"QuantizationModifier": {"scheme": "FP8", **fields}})
    assert modifier.input_args.observer == expected and modifier.input_args.num_bits == 8
    (again,) = parse_recipe(recipe_to_yaml([modifier]))  # recipe.yaml keeps the name as written
    assert again.input_args == modifier.input_args and again.args == modifier.args


def test_observer_overrides_apply_to_every_config_group():
    groups = {"a": {"targets": ["re:.*self_attn.*"], "weights": {"num_bits": 8, "strategy": "channel"}},
              "b": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32}}}
    modifiers = parse_recipe({"QuantizationModifier": {"weight_observer": "mse", "config_groups": groups}})
    assert [m.args.observer for m in modifiers] == ["mse", "mse"]


def test_observer_fields_with_nothing_to_observe_are_ignored_with_the_reason():
    with pytest.warns(ForeignFieldWarning, match="output_observer is ignored: layerwise quantizes no layer outputs"):
        parse_recipe({"GPTQModifier": {"scheme": "W4A16", "output_observer": "mse"}})
    with pytest.warns(ForeignFieldWarning, match="observer.output is ignored"):
        parse_recipe({"GPTQModifier": {"scheme": "W4A16", "observer": {"output": "mse"}}})
    with pytest.warns(ForeignFieldWarning, match="input_observer 'mse' is ignored: the scheme quantizes no layer"):
        parse_recipe({"QuantizationModifier": {"scheme": "W4A16", "input_observer": "mse"}})
    with pytest.warns(ForeignFieldWarning, match="input_observer 'mse' is ignored: the scheme computes input scales"):
        (dynamic,) = parse_recipe({"QuantizationModifier": {"scheme": "W8A8", "input_observer": "mse"}})
    assert dynamic.input_args.dynamic


@pytest.mark.parametrize("fields, fragments", [
    ({"weight_observer": "imatrix_mse"}, ["'imatrix_mse' cannot be expressed in layerwise", "nearest: observer mse"]),
    ({"observer": {"weights": "fouroversix"}}, ["'fouroversix' cannot be expressed", "nearest: observer mse"]),
    ({"observer": {"weight": "mse"}}, ["observer: unknown key(s) 'weight' (did you mean 'weights'?)",
                                       "takes weights, input, output"]),
    ({"observer": "msee"}, ["unknown observer 'msee'; did you mean 'mse'? valid observers: minmax"]),
    ({"input_observer": "static_minmaxx"}, ["unknown observer 'static_minmaxx'", "input_observer"]),
    ({"observer": {"input": "mse"}, "input_observer": "mse"}, ["observer.input and input_observer are one setting"]),
])
def test_an_observer_layerwise_does_not_have_is_refused_when_the_recipe_is_read(fields, fragments):
    """An unknown observer name failed only once the model was loaded; imatrix_mse the same, without a hint."""
    message = _error({"QuantizationModifier": {"scheme": "FP8", **fields}})
    for fragment in fragments:
        assert fragment in message


def test_a_config_group_s_observer_layerwise_does_not_have_names_the_nearest():
    group = {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128, "observer": "imatrix_mse"}}
    message = _error({"GPTQModifier": {"config_groups": {"g": group}}})
    assert "config_groups.g.weights.observer 'imatrix_mse' cannot be expressed" in message


# llm-compressor's scheme form: a preset per list of targets (as its docs' mixed-precision examples write it)
MIXED = {"QuantizationModifier": {"ignore": ["lm_head"], "scheme": {"W4A16": ["Linear"], "W8A8": ["re:.*mlp.*"]}}}


def test_a_scheme_mapping_presets_to_targets_quantizes_each_layer_with_its_preset():
    """It was read as quantization args: 'unknown quantization field(s) 'W4A16', 'W8A8''."""
    import torch

    import layerwise
    from layerwise.algorithms.quantization.storage import quantized_modules
    from tests.conftest import build_tiny_llama

    modifiers = parse_recipe(MIXED)
    assert [(m.targets, m.ignore) for m in modifiers] == [(["Linear"], ["lm_head", "re:.*mlp.*"]),
                                                          (["re:.*mlp.*"], ["lm_head"])]
    model = build_tiny_llama(hidden_size=128, intermediate_size=256)  # W4A16's groups of 128 divide each width
    layerwise.compress(model, modifiers, show_progress=False)
    quantized = quantized_modules(model)
    attention, mlp = quantized["model.layers.0.self_attn.q_proj"], quantized["model.layers.1.mlp.down_proj"]
    assert attention.quantization_args.num_bits == 4 and not hasattr(attention, "input_quantization_args")
    assert mlp.quantization_args.num_bits == 8 and mlp.input_quantization_args.dynamic
    assert "lm_head" not in quantized
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(8)[None]).logits).all()
    assert [m.args for m in parse_recipe(recipe_to_yaml(modifiers))] == [m.args for m in modifiers]


def test_a_scheme_mapping_reads_as_config_groups_do():
    (gptq,) = parse_recipe({"GPTQModifier": {"scheme": {"w4a16": "Linear"}, "targets": ["Linear"]}})
    (preset,) = parse_recipe("GPTQ_W4A16")
    assert gptq.args == preset.args and gptq.targets == ["Linear"]  # llm-compressor's default targets: unused
    from layerwise.plugins.modifiers.gptq import GPTQModifier

    one = GPTQModifier(scheme={"W8A16": ["re:.*mlp.*"]})
    assert one.targets == ["re:.*mlp.*"] and one.args.num_bits == 8


@pytest.mark.parametrize("recipe, fragments", [
    ({"GPTQModifier": {"scheme": {"W4A61": ["Linear"]}}},
     ["recipe.GPTQModifier.scheme: 'W4A61' is no preset", "did you mean 'W4A16'?"]),
    ({"GPTQModifier": {"scheme": {"W4A16": ["Linear"]}, "targets": ["re:.*mlp.*"]}},
     ["with scheme {preset: targets} the targets go in the mapping"]),
    ({"GPTQModifier": {"scheme": {"W4A16": ["Linear"]}, "group_size": 32}},
     ["give scheme {preset: targets} or group_size, not both"]),
    ({"GPTQModifier": {"scheme": {"W4A16": 4}}}, ["scheme.W4A16: give the layers this preset quantizes"]),
    ({"AWQModifier": {"scheme": {"W4A16_ASYM": ["Linear"], "W8A16": ["re:.*mlp.*"]}}},
     ["recipe.AWQModifier.scheme: AWQModifier takes 1 config group", "got 2"]),
])
def test_a_scheme_mapping_layerwise_cannot_build_names_the_field(recipe, fragments):
    message = _error(recipe)
    for fragment in fragments:
        assert fragment in message


def test_a_python_modifier_with_several_presets_says_how_to_build_them():
    from layerwise.plugins.modifiers.quantization import QuantizationModifier

    with pytest.raises(RecipeError, match=r"got 2 presets; one QuantizationModifier object holds one scheme: pass "
                                          r"the recipe as a mapping"):
        QuantizationModifier(scheme=MIXED["QuantizationModifier"]["scheme"])


def test_llm_compressor_s_saved_default_targets_beside_config_groups_are_unused_as_there():
    """llm-compressor writes targets: [Linear] into the recipes it saves, beside config_groups, where it ignores
    them; layerwise refused the pair ('the targets go in each group')."""
    group = {"g": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 8, "strategy": "channel"}}}
    (modifier,) = parse_recipe({"QuantizationModifier": {"targets": ["Linear"], "config_groups": group}})
    assert modifier.targets == ["re:.*mlp.*"]


def test_bypass_divisibility_checks_false_is_what_layerwise_does():
    """llm-compressor writes bypass_divisibility_checks: false into every recipe it saves; it was refused."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (modifier,) = parse_recipe({"GPTQModifier": {"scheme": "W4A16", "bypass_divisibility_checks": False}})
    assert modifier.args.group_size == 128
    assert "put a layer it does not divide in ignore" in _error(
        {"GPTQModifier": {"scheme": "W4A16", "bypass_divisibility_checks": True}})


def test_an_input_observer_beside_several_presets_reaches_the_ones_with_static_inputs_without_a_warning():
    import warnings

    recipe = {"QuantizationModifier": {"scheme": {"W4A16": ["Linear"], "FP8": ["re:.*mlp.*"]},
                                       "observer": {"weights": "mse", "input": "static_minmax"}}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        weight_only, fp8 = parse_recipe(recipe)
    assert (weight_only.args.observer, fp8.args.observer) == ("mse", "mse")
    assert weight_only.input_args is None and fp8.input_args.observer == "minmax"
