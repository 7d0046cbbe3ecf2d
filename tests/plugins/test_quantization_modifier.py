"""QuantizationModifier (round-to-nearest) on a tiny Llama, driven through the lifecycle."""

import pytest
import torch

from layerwise.algorithms.quantization.presets import PRESETS
from layerwise.algorithms.quantization.qmath import fake_quantize_weight, weight_qparams
from layerwise.algorithms.quantization.storage import quantized_modules
from layerwise.errors import RecipeError, UnknownNameError
from layerwise.host.lifecycle import Lifecycle
from layerwise.host.plugin_manager import registry
from layerwise.host.recipe import parse_recipe
from layerwise.host.state import CompressionState
from tests.conftest import build_tiny_llama


def QuantizationModifier(**kwargs):
    return registry("modifiers").get("QuantizationModifier")(**kwargs)


def run(model, modifier, ignore=(), epochs=None):
    lifecycle = Lifecycle(CompressionState(model, [modifier], ignore=list(ignore)))
    lifecycle.initialize()
    lifecycle.calibration_start()
    for modules in epochs or []:
        lifecycle.sequential_epoch_end(modules)
    lifecycle.calibration_end()
    lifecycle.finalize()
    return model


def linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("scheme, overrides", [
    ("W4A16", {"group_size": 32}),
    ("W4A16_ASYM", {"group_size": 16}),
    ("W8A16", {}),
    ("W4A16", {"strategy": "channel"}),
])
def test_every_target_equals_the_reference_fake_quant(scheme, overrides):
    model = build_tiny_llama()
    original = {n: m.weight.detach().clone() for n, m in linears(model).items()}
    modifier = QuantizationModifier(scheme=scheme, **overrides)
    run(model, modifier)
    args = PRESETS[scheme].weights.replace(**overrides)
    assert modifier.args == args
    assert set(quantized_modules(model)) == set(original) - {"lm_head"}
    for name, module in linears(model).items():
        if name == "lm_head":
            assert torch.equal(module.weight, original[name])
            continue
        scale, zp = weight_qparams(original[name], args)
        assert torch.equal(module.weight, fake_quantize_weight(original[name], scale, zp, args)), name
        assert not torch.equal(module.weight, original[name])
        assert torch.equal(module.weight_scale, scale)


def test_sequential_epochs_quantize_as_they_go():
    model = build_tiny_llama()
    modifier = QuantizationModifier(scheme="W8A16")
    lifecycle = Lifecycle(CompressionState(model, [modifier]))
    lifecycle.initialize()
    lifecycle.calibration_start()
    lifecycle.sequential_epoch_end(["model.layers.0"])
    done = set(quantized_modules(model))
    assert done and all(n.startswith("model.layers.0.") for n in done)
    lifecycle.sequential_epoch_end(["model.layers.1.mlp.up_proj"])
    assert "model.layers.1.mlp.up_proj" in quantized_modules(model)
    assert "model.layers.1.mlp.down_proj" not in quantized_modules(model)
    lifecycle.calibration_end()
    assert len(quantized_modules(model)) == 14


def test_state_ignore_and_regex_targets():
    model = run(build_tiny_llama(), QuantizationModifier(scheme="W8A16", targets=["re:.*mlp\\..*"]),
                ignore=["re:.*down_proj"])
    assert set(quantized_modules(model)) == {f"model.layers.{i}.mlp.{p}" for i in (0, 1)
                                              for p in ("gate_proj", "up_proj")}


def test_requires_no_data():
    assert QuantizationModifier().requires_data is False


def test_unknown_scheme_lists_valid_ones():
    with pytest.raises(UnknownNameError) as info:
        QuantizationModifier(scheme="W5A16")
    assert "W4A16_ASYM" in str(info.value) and "W8A16" in str(info.value)
    with pytest.raises(RecipeError, match="W8A16"):  # through a recipe too
        parse_recipe({"QuantizationModifier": {"scheme": "W5A16"}})


def test_unknown_scheme_field_lists_valid_ones():
    with pytest.raises(RecipeError, match="'bits'.*valid fields: num_bits"):
        QuantizationModifier(scheme={"bits": 4})
    with pytest.raises(RecipeError, match="valid num_bits: 2, 3, 4, 8"):
        QuantizationModifier(num_bits=5)


def test_missing_target_is_named_with_what_the_model_has():
    with pytest.raises(RecipeError) as info:
        run(build_tiny_llama(), QuantizationModifier(scheme="W8A16", targets=["Linear", "QKVLinear"]))
    message = str(info.value)
    assert "'QKVLinear'" in message and "LlamaDecoderLayer" in message and "q_proj" in message


def test_indivisible_group_names_the_layer_and_the_fix():
    with pytest.raises(RecipeError) as info:
        run(build_tiny_llama(), QuantizationModifier(scheme="W4A16"))  # hidden 64, group 128
    message = str(info.value)
    assert "model.layers.0.self_attn.q_proj" in message and "channel" in message and "group_size 64" in message


def test_a_group_size_the_strategy_ignores_is_an_error_naming_the_fix():
    with pytest.raises(RecipeError, match="group_size 32 has no effect with strategy 'channel'.*add strategy: group"):
        QuantizationModifier(scheme="FP8_DYNAMIC", group_size=32)
    assert QuantizationModifier(scheme="W8A16", strategy="group", group_size=32).args.effective_group_size == 32


def test_unknown_observer_lists_registered_ones():
    with pytest.raises(UnknownNameError, match="unknown observer .nmse.*valid observers: minmax, moving_average_minmax, mse"):
        run(build_tiny_llama(), QuantizationModifier(scheme="W8A16", observer="nmse"))


def test_recipe_round_trip_keeps_only_given_fields():
    from layerwise.host.recipe import recipe_to_yaml

    (modifier,) = parse_recipe({"QuantizationModifier": {"scheme": "W4A16", "group_size": 32}})
    text = recipe_to_yaml([modifier])
    assert "num_bits" not in text and "group_size: 32" in text
    (again,) = parse_recipe(text)
    assert again.args == modifier.args


def test_an_ignore_entry_matching_nothing_is_warned_about_with_the_closest_name():
    import warnings

    from layerwise.common.matching import IgnoreWarning

    modifier = QuantizationModifier(scheme="W8A16", ignore=["lm_head", "re:.*down_prj"])
    with pytest.warns(IgnoreWarning, match=r"'re:\.\*down_prj' matches no module.*did you mean 're:\.\*down_proj'"):
        model = run(build_tiny_llama(), modifier)
    assert "model.layers.0.mlp.down_proj" in quantized_modules(model)  # what the warning is about
    encoder = torch.nn.Sequential(torch.nn.Linear(8, 8))  # no lm_head: the default entry says nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", IgnoreWarning)
        run(encoder, QuantizationModifier(scheme="W8A16"))


def test_every_layer_a_group_size_does_not_divide_is_named_at_once():
    with pytest.raises(RecipeError) as raised:
        run(build_tiny_llama(), QuantizationModifier(scheme="W4A16", group_size=48))
    message = str(raised.value)
    assert "does not divide in_features 64 of layer 'model.layers.0.self_attn.q_proj' (and 13 more:" in message
    assert "add them to ignore" in message and "group_size 64" in message  # the largest that divides every width


@pytest.mark.parametrize("targets", [["LlamaDecoderLayer"], ["re:.*self_attn"]])
def test_targets_selecting_only_blocks_say_so_instead_of_blaming_ignore(targets):
    from layerwise.host.state import CompressionState
    from layerwise.plugins.modifiers.quantization import targeted_modules

    state = CompressionState(build_tiny_llama(), [], ignore=["lm_head"])
    with pytest.raises(RecipeError) as info:
        targeted_modules("QuantizationModifier", state, targets, ["lm_head"])
    message = str(info.value)
    assert "these targets select modules without a weight (blocks)" in message
    assert "use Linear or the layers inside" in message and "ignore" not in message


def test_the_all_ignored_error_lists_each_ignore_entry_once():
    from layerwise.host.state import CompressionState
    from layerwise.plugins.modifiers.quantization import targeted_modules

    state = CompressionState(build_tiny_llama(), [], ignore=["lm_head"])
    with pytest.raises(RecipeError, match=r"is ignored \(ignore \['lm_head', 're:.*proj'\]\)"):
        targeted_modules("QuantizationModifier", state, ["Linear"], ["lm_head", "re:.*proj"])


def test_an_ignore_entry_matching_only_blocks_is_warned_about_with_the_pattern_to_write():
    """llm-compressor's re: entries match a name's start, so its 're:.*mlp' keeps 20 layers out; layerwise's match
    the whole name, so the same entry keeps nothing out: say so, with the pattern that does."""
    from layerwise.common.matching import IgnoreWarning
    from layerwise.host.state import CompressionState
    from layerwise.plugins.modifiers.quantization import targeted_modules

    state = CompressionState(build_tiny_llama(), [], ignore=["lm_head"])
    with pytest.warns(IgnoreWarning) as record:
        found = targeted_modules("QuantizationModifier", state, ["Linear"], ["lm_head", "re:.*mlp", "re:model.layers.0"])
    messages = [str(w.message) for w in record]
    assert any("'re:.*mlp' matches only modules without a weight ('model.layers.0.mlp', 'model.layers.1.mlp')"
               in m and r"write 're:.*mlp\..*'" in m for m in messages), messages
    assert any("'re:model.layers.0' matches only modules without a weight ('model.layers.0')" in m
               and r"write 're:model.layers.0\..*'" in m for m in messages), messages
    assert "model.layers.0.mlp.up_proj" in found  # layerwise's documented full match is kept
