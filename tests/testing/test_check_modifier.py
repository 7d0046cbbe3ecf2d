"""layerwise.testing.check_modifier: the built-in modifiers pass it, and it catches broken ones by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from layerwise.host.modifier import Modifier
from layerwise.host.plugin_manager import registry
from layerwise.testing import PluginCheckError, check_modifier

#: every built-in modifier with non-default fields (the round trip can only lose what differs from defaults)
BUILT_IN = [
    ("QuantizationModifier", {"scheme": "W8A16", "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]}),
    ("GPTQModifier", {"scheme": "W4A16", "group_size": 32, "block_size": 64, "dampening_frac": 0.02}),
    ("SparseGPTModifier", {"mask_structure": "2:4", "block_size": 32, "dampening_frac": 0.05}),
    ("WandaModifier", {"sparsity": 0.3, "owl_m": 5, "owl_lmbda": 0.05}),
    ("WandaModifier", {"mask_structure": "2:4", "true_sequential": True}),
    ("SmoothQuantModifier", {"smoothing_strength": 0.7,
                             "mappings": [[["re:.*q_proj", "re:.*k_proj", "re:.*v_proj"], "re:.*input_layernorm"]]}),
    ("AWQModifier", {"group_size": 32, "n_grid": 10, "duo_scaling": False, "search_tokens": 512,
                     "mappings": [[["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"]]}),
    ("AutoRoundModifier", {"group_size": 32, "iters": 3, "batch_size": 2, "nsamples": 8}),
    ("RotationModifier", {"rotation": "orthogonal", "seed": 3}),
]


@pytest.mark.parametrize("name, fields", BUILT_IN)
def test_the_built_in_modifiers_pass_the_kit(name, fields):
    check_modifier(registry("modifiers").get(name), fields)


def test_every_built_in_modifier_is_held_to_the_kit():
    built_in = {name for name, cls in registry("modifiers").items() if cls.__module__.startswith("layerwise.")}
    assert built_in == {name for name, _ in BUILT_IN}


@pytest.fixture
def registered():
    """Register test modifiers for one test (recipes name them), forgotten afterwards."""
    table = registry("modifiers")

    def add(cls):
        table.add(cls.__name__, cls, owner="kit-test")
        return cls

    yield add
    table.remove_owner("kit-test")


def zero_inputs(module, args):
    return None


@dataclass
class LeaksOnError(Modifier):
    """Removes its own hook at calibration_end: fine on success, left behind when a forward fails."""

    def on_calibration_start(self, state) -> None:
        self.handle = state.model.model.layers[0].mlp.up_proj.register_forward_pre_hook(zero_inputs)

    def on_calibration_end(self, state) -> None:
        self.handle.remove()


@dataclass
class LosesAField(Modifier):
    strength: float = 1.0

    def to_dict(self) -> dict[str, Any]:
        return {type(self).__name__: {}}


@dataclass
class ReadsOutputs(Modifier):
    """Claims to read only inputs, but hooks an output."""

    def on_calibration_start(self, state) -> None:
        self.register_hook(state.model.model.layers[0].mlp.up_proj, lambda m, a, o: None, "forward")

    def calibration_inputs(self, modules: list[str]) -> set[str]:
        return {"model.layers.0.mlp.up_proj"}


@dataclass
class Unregistered(Modifier):
    pass


def test_a_modifier_that_leaks_a_hook_on_error_is_caught(registered):
    registered(LeaksOnError)
    with pytest.raises(PluginCheckError, match=r"check_modifier\(LeaksOnError\): hooks after an error: 1 hook"):
        check_modifier(LeaksOnError)


def test_a_modifier_whose_yaml_round_trip_loses_a_field_is_caught(registered):
    registered(LosesAField)
    with pytest.raises(PluginCheckError, match=r"round trip: YAML -> object -> YAML changes strength: 0.5 -> 1.0"):
        check_modifier(LosesAField, {"strength": 0.5})


def test_a_modifier_that_hooks_outputs_while_naming_inputs_is_caught(registered):
    registered(ReadsOutputs)
    with pytest.raises(PluginCheckError, match=r"calibration_inputs: .*forward \(output\) hook on "
                                               r"'model.layers.0.mlp.up_proj'"):
        check_modifier(ReadsOutputs)


def test_an_unregistered_modifier_is_caught_with_how_to_register_it():
    with pytest.raises(PluginCheckError, match=r"registered: .*layerwise_register_modifiers"):
        check_modifier(Unregistered)


def test_the_failure_is_an_assertion_error_for_pytest():
    assert issubclass(PluginCheckError, AssertionError)


def test_pytest_loads_the_kit_as_fixtures_through_its_entry_point(layerwise_check_modifier, layerwise_tiny_llama):
    assert layerwise_check_modifier is check_modifier  # no import needed in a plugin's tests
    assert len(layerwise_tiny_llama().model.layers) == 2
