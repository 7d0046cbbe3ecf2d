"""layerwise discovers this installed distribution and uses what it registered."""

import torch
from layerwise_starcoder2 import STARCODER2, tiny_starcoder2

import layerwise
from layerwise.plugin import get_host


def test_discovered_through_the_entry_point():
    info = get_host().plugins["starcoder2"]
    assert info.distribution == "layerwise-starcoder2" and info.broken is None
    assert info.registered == {"model_patches": ["starcoder2"], "modifiers": ["MagnitudePruningModifier"]}


def test_patch_is_chosen_for_starcoder2():
    model = tiny_starcoder2()
    layerwise.compress(model, "W4A16", show_progress=False)
    assert model._layerwise_patch.name == "starcoder2"
    assert "lm_head" not in model.layerwise_report.compressed_modules


def test_modifier_runs_from_a_yaml_recipe():
    model = tiny_starcoder2()
    head = model.lm_head.weight.clone()
    layerwise.compress(model, "MagnitudePruningModifier:\n  sparsity: 0.5\n", show_progress=False)
    proj = model.model.layers[0].mlp.c_fc.weight
    assert abs((proj == 0).float().mean().item() - 0.5) < 0.01
    assert torch.equal(model.lm_head.weight, head)


def test_modifier_keeps_layerwise_s_modifier_contract(layerwise_check_modifier):
    from layerwise_starcoder2 import MagnitudePruningModifier

    layerwise_check_modifier(MagnitudePruningModifier, {"sparsity": 0.3})


def test_patch_passes_the_plugin_kit(layerwise_check_model_patch):
    # ignore entries, targets, trace and exact replay, RTN and GPTQ through sequential, save and reload
    layerwise_check_model_patch(STARCODER2, tiny_starcoder2())
