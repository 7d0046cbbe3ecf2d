"""llm-compressor's per-layer sparsity list on SparseGPT and Wanda: one value per module the targets select,
the layers inside each pruned to it; a list that cannot apply is an error before any calibration."""

from __future__ import annotations

import pytest
import torch

import layerwise
from layerwise.errors import RecipeError
from layerwise.host.recipe import parse_recipe, recipe_to_yaml
from tests.conftest import build_tiny_llama
from tests.plugins.pipelines.helpers import make_batches

BLOCKS = r"re:model.layers.\d+$"


def prune(recipe):
    model = build_tiny_llama()
    layerwise.compress(model, recipe, dataset=make_batches(lengths=(16,) * 6), show_progress=False)
    return model


def zeros(layer: torch.nn.Linear) -> float:
    return float((layer.weight == 0).float().mean())


@pytest.mark.parametrize("name", ["SparseGPTModifier", "WandaModifier"])
def test_each_block_is_pruned_to_its_own_sparsity(name):
    """It was refused: 'sparsity must be a fraction in [0, 1)'."""
    (modifier,) = parse_recipe({name: {"sparsity": [0.25, 0.75], "targets": [BLOCKS]}})
    model = prune(modifier)
    for block, expected in ((0, 0.25), (1, 0.75)):
        for layer in ("self_attn.q_proj", "mlp.down_proj"):
            assert zeros(model.get_submodule(f"model.layers.{block}.{layer}")) == pytest.approx(expected, abs=0.01)
    assert (model.lm_head.weight != 0).all()
    assert parse_recipe(recipe_to_yaml([modifier]))[0].sparsity_list == [0.25, 0.75]


def test_a_layer_selected_itself_takes_its_own_value_over_its_blocks():
    """llm-compressor gives a layer the value of the last selected module holding it: itself, when listed."""
    recipe = {"WandaModifier": {"sparsity": [0.25, 0.5, 0.75], "ignore": ["lm_head"],
                                "targets": [BLOCKS, "model.layers.1.mlp.up_proj"]}}
    model = prune(recipe)
    assert zeros(model.model.layers[1].mlp.up_proj) == pytest.approx(0.75, abs=0.01)
    assert zeros(model.model.layers[1].mlp.gate_proj) == pytest.approx(0.5, abs=0.01)


def test_a_list_of_the_wrong_length_is_refused_before_calibrating(monkeypatch):
    from layerwise.plugins.modifiers.wanda import WandaModifier

    monkeypatch.setattr(WandaModifier, "on_calibration_start",
                        lambda *a: pytest.fail("calibration started"), raising=True)
    with pytest.raises(RecipeError) as info:
        prune({"WandaModifier": {"sparsity": [0.5, 0.5, 0.5], "targets": [BLOCKS]}})
    assert "WandaModifier.sparsity lists 3 values, one per module the targets" in str(info.value)
    assert "they select 2: 'model.layers.0', 'model.layers.1'; give 2 values" in str(info.value)


@pytest.mark.parametrize("fields, message", [
    ({"sparsity": [0.5, 1.2]}, r"SparseGPTModifier.sparsity\[1\] must be a fraction in \[0, 1\)"),
    ({"sparsity": []}, r"sparsity is an empty list"),
    ({"sparsity": [0.5, 0.3], "mask_structure": "2:4"}, r"sparsity 0.3 contradicts mask_structure '2:4'"),
    ({"sparsity": [0.5, 0.6], "owl_m": 5, "owl_lmbda": 0.08}, r"give sparsity as one number with OWL"),
])
def test_a_list_that_cannot_apply_is_refused_when_the_recipe_is_read(fields, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe({"SparseGPTModifier": fields})
