"""GPTAQ (``GPTQModifier(gptaq=True)``): GPTQ aimed at the uncompressed model's outputs.

The asymmetric target is checked against the least-squares solution written out, the pipeline's second
stream against the identity that the first block sees the same inputs in both models, and the whole
against plain GPTQ on the quantity GPTAQ minimises.
"""

from __future__ import annotations

import copy

import pytest
import torch

import layerwise
from layerwise.errors import RecipeError
from layerwise.host.recipe import parse_recipe, recipe_to_yaml
from layerwise.plugins.modifiers.gptaq import AsymmetricTerms
from layerwise.testing import token_batches
from tests.conftest import build_tiny_llama

BATCHES = token_batches(16, 32, vocab=128)
W3 = {"scheme": "W4A16", "num_bits": 3, "group_size": 32}


def feed(terms: AsymmetricTerms, name: str, original: torch.Tensor, compressed: torch.Tensor) -> None:
    layer = torch.nn.Linear(original.shape[-1], 4)
    terms.original_hook(name)(layer, (original,), {})
    terms.compressed_hook(name)(layer, (compressed,), {})


def test_the_asymmetric_target_is_the_least_squares_fit_of_the_original_outputs():
    torch.manual_seed(0)
    original = torch.randn(3, 50, 16, dtype=torch.float64)
    compressed = original + 0.1 * torch.randn_like(original)  # inputs with earlier layers' error
    weight = torch.randn(8, 16, dtype=torch.float64)
    terms = AsymmetricTerms()
    for batch in range(3):  # one batch at a time, as the pipeline feeds them
        feed(terms, "layer", original[batch].float(), compressed[batch].float())
    x, x_tilde = original.reshape(-1, 16).T, compressed.reshape(-1, 16).T  # inputs as columns
    hessian = (2 / x.shape[1] * x_tilde @ x_tilde.T).float()
    target, record = terms.target("layer", weight.float(), hessian, alpha=1.0, dampening_frac=0.0)
    # argmin_V ||W X - V X~||: the fit of the original outputs reachable from the compressed inputs
    expected = weight @ x @ x_tilde.T @ torch.linalg.inv(x_tilde @ x_tilde.T)
    torch.testing.assert_close(target.double(), expected, rtol=1e-4, atol=1e-4)
    assert record["gptaq_shift"] > 0 and "layer" not in terms.cross  # taken once


def test_equal_inputs_leave_the_weight_alone():
    torch.manual_seed(1)
    x = torch.randn(64, 8)
    weight = torch.randn(4, 8)
    same = AsymmetricTerms()
    feed(same, "layer", x, x.clone())
    assert torch.equal(same.target("layer", weight, 2 / 64 * x.T @ x, 0.25, 0.01)[0], weight)  # P = 0


def test_the_step_is_linear_in_alpha():
    torch.manual_seed(2)
    x = torch.randn(64, 8)
    noisy = x + 0.2 * torch.randn_like(x)
    weight, hessian = torch.randn(4, 8), 2 / 64 * noisy.T @ noisy
    steps = []
    for alpha in (0.5, 1.0):
        terms = AsymmetricTerms()
        feed(terms, "layer", x, noisy)
        steps.append(terms.target("layer", weight, hessian, alpha, 0.01)[0] - weight)
    torch.testing.assert_close(2 * steps[0], steps[1], rtol=1e-5, atol=1e-6)


def compress(recipe: dict, pieces: str | None = None):
    torch.manual_seed(0)
    model = build_tiny_llama(hidden_size=128, intermediate_size=256)
    original = copy.deepcopy(model)
    options = layerwise.CompressOptions.of(pieces=pieces) if pieces else None
    layerwise.compress(model, {"GPTQModifier": recipe}, dataset=BATCHES, show_progress=False, options=options)
    return original, model


def output_error(original, model) -> float:
    with torch.no_grad():
        return sum(float(((model(**b).logits - original(**b).logits) ** 2).mean()) for b in BATCHES)


def test_the_first_block_sees_the_same_inputs_in_both_streams_so_gptaq_solves_it_as_gptq():
    _, gptaq = compress({**W3, "gptaq": True})
    _, gptq = compress(W3, pieces="blocks")  # GPTQ at the same cut
    assert gptaq.layerwise_report.pieces.startswith("blocks")
    first = "model.layers.0.mlp.down_proj"
    torch.testing.assert_close(gptaq.get_submodule(first).weight, gptq.get_submodule(first).weight)
    later = "model.layers.1.self_attn.q_proj"  # reads the compressed block 0's outputs: corrected
    assert not torch.equal(gptaq.get_submodule(later).weight, gptq.get_submodule(later).weight)
    records = {r["name"]: r for r in gptaq.layerwise_report.layer_log if r.get("modifier") == "GPTQModifier"}
    assert records[first]["gptaq_shift"] == 0 and records[later]["gptaq_shift"] > 0


def test_gptaq_brings_the_outputs_closer_to_the_original_model_than_gptq():
    original, gptaq = compress({**W3, "gptaq": True})
    _, gptq = compress(W3)
    _, gptq_blocks = compress(W3, pieces="blocks")
    assert output_error(original, gptaq) < min(output_error(original, gptq), output_error(original, gptq_blocks))


def test_gptaq_fields_are_checked_and_round_trip():
    with pytest.raises(RecipeError, match="gptaq must be true or false"):
        parse_recipe({"GPTQModifier": {"gptaq": "yes"}})
    with pytest.raises(RecipeError, match=r"gptaq_alpha must be a number in \[0, 1\]"):
        parse_recipe({"GPTQModifier": {"gptaq": True, "gptaq_alpha": 2}})
    (modifier,) = parse_recipe({"GPTQModifier": {"gptaq": True, "gptaq_alpha": 0.5}})
    (again,) = parse_recipe(recipe_to_yaml([modifier]))
    assert again.gptaq and again.gptaq_alpha == 0.5 and again.needs_reference_inputs


def test_a_saved_gptaq_checkpoint_reloads_to_the_in_memory_outputs(tmp_path):
    """GPTAQ moves the weights GPTQ rounds (towards the original model's outputs); what is saved is still
    integers on the scales' grid: transformers and load_compressed reload the in-memory model's outputs."""
    import json

    from transformers import AutoModelForCausalLM

    model = build_tiny_llama()
    out = tmp_path / "gptaq"
    recipe = "GPTQModifier:\n  scheme: W4A16\n  group_size: 32\n  ignore: [lm_head]\n  gptaq: true\n"
    layerwise.compress(model, recipe, dataset=BATCHES, output_dir=out, show_progress=False, device="cpu")
    records = [r for r in model.layerwise_report.layer_log if r.get("modifier") == "GPTQModifier"]
    assert len(records) == 14 and any(r["gptaq_shift"] > 0 for r in records)  # GPTAQ moved later layers' targets
    assert "gptaq: true" in (out / "recipe.yaml").read_text()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
        for reloaded in (AutoModelForCausalLM.from_pretrained(out).eval(), layerwise.load_compressed(out).eval()):
            torch.testing.assert_close(reloaded(ids).logits, expected, rtol=1e-4, atol=1e-4)
