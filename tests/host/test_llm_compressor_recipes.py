"""llm-compressor recipes read as written: config_groups become layerwise schemes, its extra fields are ignored
with the reason or refused naming the equivalent, and what layerwise cannot express names the field."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization.config_groups import ConfigGroupWarning
from layerwise.algorithms.quantization.storage import quantized_modules
from layerwise.errors import RecipeError
from layerwise.host.recipe import parse_recipe, recipe_to_yaml
from layerwise.plugin import ForeignFieldWarning
from layerwise.testing import token_batches
from tests.conftest import build_tiny_llama

# as llm-compressor's examples write a GPTQ int4 recipe (its docs' sample, with mse)
LLMC_GPTQ_W4A16 = """
quant_stage:
  quant_modifiers:
    GPTQModifier:
      sequential_update: true
      dampening_frac: 0.01
      ignore: [lm_head]
      config_groups:
        group_0:
          weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128, actorder: weight}
          targets: [Linear]
          input_activations: null
          output_activations: null
"""
BATCHES = token_batches(4, 16, vocab=128)


def logits(model):
    with torch.no_grad():
        return model(**BATCHES[0]).logits


def test_speed_settings_and_the_owl_profile_are_read_and_ignored_with_the_reason():
    """batched_quantization (GPTQ) and sparsity_profile: owl (beside owl_m / owl_lmbda, which llm-compressor
    requires with it) were bare 'unknown field' errors: every llm-compressor OWL recipe failed."""
    with pytest.warns(ForeignFieldWarning, match="batched_quantization is ignored: llm-compressor's speed setting"):
        (gptq,) = parse_recipe({"GPTQModifier": {"scheme": "W4A16", "batched_quantization": "auto"}})
    assert gptq.args.num_bits == 4
    with pytest.warns(ForeignFieldWarning, match="sparsity_profile is ignored: layerwise's OWL is on exactly when"):
        (owl,) = parse_recipe({"SparseGPTModifier": {"sparsity": 0.5, "sparsity_profile": "owl", "owl_m": 5,
                                                     "owl_lmbda": 0.08}})
    assert (owl.owl_m, owl.owl_lmbda) == (5, 0.08)


def test_num_bits_written_as_a_string_is_read_as_compressed_tensors_reads_it():
    """compressed-tensors' pydantic args read num_bits "4" as 4; layerwise said 'nearest: num_bits: 8'."""
    group = {"targets": ["Linear"], "weights": {"num_bits": "4", "strategy": "group", "group_size": 32}}
    (modifier,) = parse_recipe({"QuantizationModifier": {"config_groups": {"g": group}}})
    assert modifier.args.num_bits == 4 and modifier.args.group_size == 32


def test_a_config_groups_gptq_recipe_is_the_gptq_w4a16_preset():
    with pytest.warns(ForeignFieldWarning, match=r"sequential_update is ignored: layerwise always calibrates"):
        (modifier,) = parse_recipe(LLMC_GPTQ_W4A16)
    (preset,) = parse_recipe("GPTQ_W4A16")
    assert type(modifier) is type(preset) and modifier.args == preset.args
    assert modifier.targets == ["Linear"] and modifier.ignore == ["lm_head"] and modifier.input_args is None
    models = []
    for recipe in (modifier, preset):  # the same run, bit for bit
        model = build_tiny_llama(hidden_size=128, intermediate_size=256)
        layerwise.compress(model, recipe, dataset=BATCHES, show_progress=False)
        models.append(model)
    assert torch.equal(logits(models[0]), logits(models[1]))
    again = parse_recipe(recipe_to_yaml([modifier]))  # recipe.yaml rebuilds it
    assert again[0].args == modifier.args


@pytest.mark.parametrize("weights, inputs, preset", [
    ({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
     {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}, "W8A8"),
    ({"num_bits": 8, "type": "float", "strategy": "channel"},
     {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}, "FP8_DYNAMIC"),
    ({"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [128, 128]},
     {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "dynamic": True}, "FP8_BLOCK"),
    ({"num_bits": 4, "symmetric": False, "group_size": 128}, None, "W4A16_ASYM"),  # strategy from group_size
    ({"num_bits": 8, "group_size": -1}, None, "W8A16"),  # -1: channel
    # compressed-tensors' NVFP4 scheme: the inputs' block scales at run time ("local") under a calibrated global one
    ({"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "observer": "static_minmax"},
     {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "dynamic": "local",
      "observer": "static_minmax"}, "NVFP4"),
])
def test_config_groups_map_to_the_presets_they_spell(weights, inputs, preset):
    group = {"targets": ["Linear"], "weights": weights, "input_activations": inputs}
    (modifier,) = parse_recipe({"QuantizationModifier": {"config_groups": {"group_0": group}}})
    (expected,) = parse_recipe(preset)
    assert modifier.args.replace(observer="minmax") == expected.args
    assert modifier.input_args == expected.input_args or (
        modifier.input_args.replace(observer="minmax") == expected.input_args.replace(observer="minmax"))


def test_two_groups_quantize_each_layer_once_and_load_in_plain_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    recipe = {"QuantizationModifier": {"ignore": ["lm_head"], "config_groups": {
        "mlp": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32}},
        "attention": {"targets": ["re:.*self_attn.*"],
                      "weights": {"num_bits": 8, "strategy": "channel"},
                      "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": True}}}}}
    modifiers = parse_recipe(recipe)
    assert [m.targets for m in modifiers] == [["Linear"], ["re:.*self_attn.*"]]
    assert modifiers[0].ignore == ["lm_head", "re:.*self_attn.*"] and modifiers[1].ignore == ["lm_head"]
    model = build_tiny_llama()
    layerwise.compress(model, modifiers, output_dir=tmp_path / "out", show_progress=False)
    quantized = quantized_modules(model)
    assert quantized["model.layers.0.self_attn.q_proj"].quantization_args.num_bits == 8
    assert quantized["model.layers.0.self_attn.q_proj"].input_quantization_args.dynamic
    assert quantized["model.layers.0.mlp.up_proj"].quantization_args.num_bits == 4
    assert "lm_head" not in quantized
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "mixed-precision" and len(config["config_groups"]) == 2
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    expected = logits(model)
    torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=1e-5 * expected.abs().max().item())


@pytest.mark.parametrize("group, fragments", [
    ({"targets": ["Linear"], "weights": {"num_bits": 6, "type": "float", "strategy": "group", "group_size": 32}},
     ["config_groups.g.weights: type float with num_bits 6", "num_bits 8 (FP8 E4M3) or 4 (FP4 E2M1"]),
    ({"targets": ["Linear"], "weights": {"num_bits": 6}}, ["weights.num_bits 6", "nearest: num_bits: 8"]),
    ({"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 16, "strategy": "tensor_group"}},
     ["config_groups.g.weights: strategy 'tensor_group'", "NVFP4's: type float, num_bits 4"]),
    ({"targets": ["Linear"], "weights": {"num_bits": 8}, "output_activations": {"num_bits": 8}},
     ["config_groups.g.output_activations", "nearest: input_activations"]),
    ({"targets": ["Linear"], "input_activations": {"num_bits": 8, "dynamic": True}},
     ["config_groups.g.weights", "activations only", "W8A8"]),
    ({"targets": ["Linear"], "weights": {"num_bits": 8, "observer_kwargs": {"averaging_constant": 0.1}}},
     ["weights.observer_kwargs", "take no arguments"]),
    ({"targets": ["Linear"], "weights": {"num_bits": 8, "scale_dtype": "float16"}},
     ["weights.scale_dtype 'float16' cannot be chosen", "the weight's dtype"]),
    ({"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128, "actorder": True}},
     ["weights.actorder true", "actorder: weight"]),
    ({"targets": ["Linear"], "weights": {"num_bits": 4, "blocksize": 128}},
     ["unknown field(s) 'blocksize'", "num_bits, type, symmetric"]),
    ({"weights": {"num_bits": 4}}, ["config_groups.g.targets", "targets: [Linear]"]),
    ({"targets": ["Linear"], "weights": {"num_bits": 8},
      "input_activations": {"num_bits": 8, "strategy": "token", "dynamic": "local"}},
     ["input_activations.dynamic 'local'", "strategy tensor_group", "dynamic: true or false"]),
])
def test_what_layerwise_cannot_express_names_the_field_and_the_nearest(group, fragments):
    with pytest.raises(RecipeError) as info:
        parse_recipe({"QuantizationModifier": {"config_groups": {"g": group}}})
    for fragment in fragments:
        assert fragment in str(info.value)
    assert "recipe.QuantizationModifier.config_groups.g" in str(info.value)


def test_config_groups_conflicts_are_refused():
    group = {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128}}}
    with pytest.raises(RecipeError, match="give config_groups or scheme, not both"):
        parse_recipe({"GPTQModifier": {"scheme": "W4A16", "config_groups": group}})
    with pytest.raises(RecipeError, match="the targets go in each group"):
        parse_recipe({"GPTQModifier": {"targets": ["re:.*mlp.*"], "config_groups": group}})
    two = {**group, "h": {"targets": ["re:.*mlp.*"], "weights": {"num_bits": 8}}}
    with pytest.raises(RecipeError, match="AWQModifier takes 1 config group .* got 2"):
        parse_recipe({"AWQModifier": {"config_groups": two}})
    with pytest.raises(RecipeError, match="SmoothQuantModifier quantizes nothing"):
        parse_recipe({"SmoothQuantModifier": {"config_groups": group}})
    with pytest.warns(ConfigGroupWarning, match="format 'pack-quantized' is ignored"):
        parse_recipe({"QuantizationModifier": {"config_groups": {"g": {**group["g"], "format": "pack-quantized"}}}})


@pytest.mark.parametrize("modifier, field, value, fragment", [
    ("GPTQModifier", "offload_hessians", False, "float32 upper triangle"),
    ("SparseGPTModifier", "sequential_update", True, "true_sequential: true calibrates each layer"),
    ("SparseGPTModifier", "preserve_sparsity_mask", True, "keeps its zeros"),
    ("SmoothQuantModifier", "num_calibration_steps", 64, "every calibration sample"),
    ("AWQModifier", "offload_device", "cpu", "one block's search samples"),
    ("QuantizationModifier", "start", 0, "training schedule"),
])
def test_harmless_llm_compressor_fields_are_ignored_with_the_reason(modifier, field, value, fragment):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (built,) = parse_recipe({modifier: {field: value}})
    (warning,) = [w for w in caught if issubclass(w.category, ForeignFieldWarning)]
    assert f"recipe.{modifier}.{field} is ignored" in str(warning.message) and fragment in str(warning.message)
    assert type(built).__name__ == modifier


@pytest.mark.parametrize("modifier, field, value, fragment", [
    ("GPTQModifier", "sequential_targets", ["LlamaDecoderLayer"], "sequential_targets=[...])) (CLI: --targets)"),
    ("SmoothQuantModifier", "ignore", ["lm_head"], "choose them with mappings"),
    ("WandaModifier", "sequential_targets", ["LlamaDecoderLayer"], "(CLI: --targets)"),
])
def test_llm_compressor_fields_with_a_layerwise_equivalent_are_refused_naming_it(modifier, field, value, fragment):
    with pytest.raises(RecipeError) as info:
        parse_recipe({modifier: {field: value}})
    assert f"recipe.{modifier}.{field}: an llm-compressor field layerwise does not take" in str(info.value)
    assert fragment in str(info.value)


def test_a_python_modifier_takes_one_config_group_built_with_compressed_tensors_objects():
    from compressed_tensors.quantization import QuantizationArgs as CtArgs
    from compressed_tensors.quantization import QuantizationScheme as CtScheme

    from layerwise.plugins.modifiers.gptq import GPTQModifier

    group = CtScheme(targets=["Linear"], weights=CtArgs(num_bits=4, type="int", symmetric=True, strategy="group",
                                                        group_size=128, actorder="weight"))
    modifier = GPTQModifier(config_groups={"group_0": group}, ignore=["lm_head"])
    (preset,) = parse_recipe("GPTQ_W4A16")
    assert modifier.args == preset.args and modifier.targets == ["Linear"] and modifier.config_groups is None
    # the same objects in a recipe mapping; several groups there are one modifier each
    two = parse_recipe({"QuantizationModifier": {"config_groups": {
        "attention": CtScheme(targets=["re:.*self_attn.*"], weights=CtArgs(num_bits=8, strategy="channel")),
        "rest": CtScheme(targets=["Linear"], weights=CtArgs(num_bits=4, group_size=32))}}})
    assert [m.args.num_bits for m in two] == [8, 4] and "re:.*self_attn.*" in two[1].ignore
    assert parse_recipe(recipe_to_yaml([modifier]))[0].args == modifier.args  # saved as scheme + targets


def test_a_python_modifier_with_several_config_groups_says_how_to_build_them():
    from layerwise.plugins.modifiers.quantization import QuantizationModifier

    groups = {"a": {"targets": ["re:.*q_proj"], "weights": {"num_bits": 8}},
              "b": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32}}}
    with pytest.raises(RecipeError, match=r"got 2 groups; one QuantizationModifier object holds one scheme: pass "
                                          r"the recipe as a mapping"):
        QuantizationModifier(config_groups=groups)
    with pytest.raises(RecipeError, match="give config_groups or scheme, not both"):
        QuantizationModifier(scheme="W8A16", config_groups={"a": groups["a"]})


def test_an_error_in_the_modifiers_own_field_is_labelled_the_modifier_not_its_config_group():
    group = {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128}}
    for fields, fragment in (({"block_size": 0}, "block_size"), ({"actorder": "group"}, "GPTQModifier.actorder"),
                             ({"actorderr": "weight"}, "unknown field")):
        with pytest.raises(RecipeError, match=fragment) as info:
            parse_recipe({"GPTQModifier": {**fields, "config_groups": {"group_0": group}}})
        assert str(info.value).startswith("recipe.GPTQModifier: "), str(info.value)
    with pytest.raises(RecipeError, match="config_groups.group_0: .*contradicts"):  # both places: the group's
        parse_recipe({"GPTQModifier": {"actorder": None, "config_groups": {"group_0": {
            **group, "weights": {**group["weights"], "actorder": "weight"}}}}})
