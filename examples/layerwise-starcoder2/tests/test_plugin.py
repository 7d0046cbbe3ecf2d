"""layerwise discovers this installed distribution and uses what it registered."""

import torch
from transformers import Starcoder2Config, Starcoder2ForCausalLM

import layerwise
from layerwise.plugin_manager import get_host


def tiny_starcoder2():
    torch.manual_seed(0)
    config = Starcoder2Config(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                              bos_token_id=0, eos_token_id=0)
    return Starcoder2ForCausalLM(config).eval()


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
