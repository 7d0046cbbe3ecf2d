"""SmoothQuantModifier: exact smoothing, the paper's scales, flatter inputs, one run shared with GPTQ."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization.mappings import MappingError, resolve_mappings
from layerwise.errors import RecipeError
from layerwise.host.recipe import parse_recipe
from layerwise.model_zoo import _tiny
from layerwise.model_zoo.llama import LLAMA, tiny_llama
from layerwise.plugins.modifiers.gptq import GPTQModifier
from layerwise.plugins.modifiers.hessians import HessianBank
from layerwise.plugins.modifiers.smoothquant import SmoothQuantModifier, SmoothQuantWarning
from layerwise.testing.modifiers import count_hooks, token_batches

BATCHES = token_batches(count=4, length=16, vocab=256)


def mha_llama() -> torch.nn.Module:
    """The tiny Llama without grouped-query attention, so that v_proj -> o_proj is smoothed too."""
    from transformers import LlamaConfig

    return _tiny.seeded("LlamaForCausalLM", LlamaConfig(**{**_tiny.TEXT, "num_key_value_heads": 4}))


def logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits


def balance_input_maxima(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Per mapping of the Llama patch, the per-channel max |x| of its balance layers' input (a plain forward)."""
    mappings = resolve_mappings(model, LLAMA.smoothing_mappings, owner="test").mappings
    maxima: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(module, args):
            seen = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)
            maxima[name] = seen if name not in maxima else torch.maximum(maxima[name], seen)
        return record

    handles = [model.get_submodule(m.balance[0]).register_forward_pre_hook(hook(m.smoothed)) for m in mappings]
    try:
        with torch.no_grad():
            for batch in BATCHES:
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return maxima


@pytest.mark.parametrize("build", [tiny_llama, mha_llama])
def test_smoothing_keeps_the_function(build):
    model = build()
    before = logits(model)
    norm = model.model.layers[0].input_layernorm.weight.detach().clone()
    layerwise.compress(model, [SmoothQuantModifier()], dataset=BATCHES, show_progress=False, device="cpu")
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, norm)  # something was smoothed
    torch.testing.assert_close(logits(model), before, rtol=1e-5, atol=1e-6)
    assert count_hooks(model) == 0
    assert "SmoothQuantModifier rescales norms inside each block" in model.layerwise_report.pieces


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.8, 1.0])
def test_scales_are_the_papers(alpha):
    model = mha_llama()
    maxima = balance_input_maxima(model)
    mappings = resolve_mappings(model, LLAMA.smoothing_mappings, owner="test").mappings
    expected = {}
    for mapping in mappings:  # max|X|^a / max|W|^(1-a), over every row of every balance layer
        weight_max = torch.cat([model.get_submodule(n).weight.detach().abs() for n in mapping.balance]).amax(dim=0)
        expected[mapping.smoothed] = (maxima[mapping.smoothed].pow(alpha) / weight_max.pow(1 - alpha)).clamp(min=1e-5)
    modifier = SmoothQuantModifier(smoothing_strength=alpha)
    layerwise.compress(model, [modifier], dataset=BATCHES, show_progress=False, device="cpu")
    assert set(modifier.scales) == set(expected) and len(expected) == 8  # v_proj -> o_proj, up -> down included
    for name, scales in expected.items():
        torch.testing.assert_close(modifier.scales[name], scales, rtol=1e-5, atol=0)


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_balance_inputs_get_flatter(alpha):
    model = mha_llama()
    before = balance_input_maxima(model)
    layerwise.compress(model, [SmoothQuantModifier(smoothing_strength=alpha)], dataset=BATCHES, show_progress=False, device="cpu")
    after = balance_input_maxima(model)
    for name in before:
        flatness = (before[name].max() / before[name].mean(), after[name].max() / after[name].mean())
        assert flatness[1] < flatness[0], name


def test_one_calibration_run_serves_gptq_too():
    # GPTQ after SmoothQuant in one run reads Hessians gathered on unsmoothed inputs and rescaled (folded
    # and pending alike: 384 tokens); the reference smooths first, then runs GPTQ alone on the smoothed model
    batches = token_batches(count=6, length=64, vocab=256)
    joint = mha_llama()
    calls: list[str] = []
    counter = joint.model.layers[0].register_forward_pre_hook(lambda module, args, kwargs: calls.append(
        (args[0] if args else kwargs["hidden_states"]).device.type), with_kwargs=True)
    layerwise.compress(joint, [SmoothQuantModifier(), GPTQModifier(scheme="W8A16")], dataset=batches, show_progress=False, options=layerwise.CompressOptions.of(propagate_error=False), device="cpu")
    counter.remove()
    assert [c for c in calls if c != "meta"] == ["cpu"] * len(batches)  # one forward per batch, no second pass

    apart = mha_llama()
    layerwise.compress(apart, [SmoothQuantModifier()], dataset=batches, show_progress=False, device="cpu")
    layerwise.compress(apart, [GPTQModifier(scheme="W8A16")], dataset=batches, show_progress=False, options=layerwise.CompressOptions.of(propagate_error=False, pieces="blocks"), device="cpu")
    quantized = [name for name, m in joint.named_modules() if hasattr(m, "weight_scale")]
    assert len(quantized) == 14
    for name in quantized:
        a, b = joint.get_submodule(name), apart.get_submodule(name)
        torch.testing.assert_close(a.weight_scale, b.weight_scale, rtol=1e-4, atol=1e-8)
        assert_same_up_to_rounding_ties(a.weight, b.weight, a.weight_scale, name)


def assert_same_up_to_rounding_ties(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor, name: str) -> None:
    """Equal weights, but for a few rows that tipped over a rounding tie.

    The joint run's Hessians are rescaled, the reference's are gathered on smoothed inputs: equal
    up to float rounding, which can tip a value sitting on a rounding boundary to the next grid
    point (how often depends on the CPU's kernels); GPTQ then compensates the rest of that row
    differently, by a step or two. A wrong rescaling changes nearly every row.
    """
    steps = (a - b).abs() / scale.expand_as(a)
    assert float(steps.max()) < 2.01, f"{name}: entries differ by {float(steps.max()):.2f} grid steps"
    rows = (steps > 1e-3).any(dim=1)
    assert float(rows.float().mean()) <= 0.05, f"{name}: {int(rows.sum())} of {a.shape[0]} rows differ"


@pytest.mark.parametrize("value", [-0.1, 1.5, float("nan"), True, "half"])
def test_smoothing_strength_outside_0_1_is_a_recipe_error(value):
    with pytest.raises(RecipeError, match=r"SmoothQuantModifier\.smoothing_strength must be a number in \[0, 1\]"):
        parse_recipe({"SmoothQuantModifier": {"smoothing_strength": value}})


def test_bad_mappings_are_recipe_errors():
    with pytest.raises(MappingError, match=r"SmoothQuantModifier\.mappings is empty"):
        SmoothQuantModifier(mappings=[])
    with pytest.raises(MappingError, match=r"a mapping is \[\[balance patterns...\], smoothed pattern\]"):
        SmoothQuantModifier(mappings=[["re:.*q_proj"]])


@pytest.mark.parametrize("patch, message", [
    (False, "no smoothing mappings: no model patch matches this model, and none was found from the layout"),
    (dataclasses.replace(LLAMA, smoothing_mappings=()), "the model patch 'llama' declares no smoothing_mappings, "
                                                        "and none was found"),
])
def test_a_model_without_mappings_finds_them_from_its_layout_or_is_a_named_error(patch, message, monkeypatch):
    from layerwise.tracing import smoothing_layout

    model = tiny_llama()  # Llama's layout: the mappings are found and proven, as the patch declares them
    modifier = SmoothQuantModifier()
    layerwise.compress(model, [modifier], dataset=BATCHES, show_progress=False,
                       options=layerwise.CompressOptions.of(patch=patch))
    with_patch = SmoothQuantModifier()
    layerwise.compress(tiny_llama(), [with_patch], dataset=BATCHES, show_progress=False)
    assert sorted(modifier.scales) == sorted(with_patch.scales)
    monkeypatch.setattr(smoothing_layout, "CANDIDATES", ((("re:.*nothing_like_it",), "re:.*input_layernorm"),))
    model = tiny_llama()
    with pytest.raises(MappingError, match=message):
        layerwise.compress(model, [SmoothQuantModifier()], dataset=BATCHES, show_progress=False, options=layerwise.CompressOptions.of(patch=patch), device="cpu")
    assert count_hooks(model) == 0


def test_recipe_mappings_replace_the_patchs():
    model = tiny_llama()
    modifier = SmoothQuantModifier(mappings=[[["re:.*gate_proj", "re:.*up_proj"], "re:.*post_attention_layernorm"]])
    layerwise.compress(model, [modifier], dataset=BATCHES, show_progress=False, device="cpu")
    assert sorted(modifier.scales) == [f"model.layers.{i}.post_attention_layernorm" for i in (0, 1)]


def test_listed_after_the_quantizer_it_says_so():
    model = tiny_llama()
    with pytest.raises(RecipeError, match="list SmoothQuantModifier before the quantizing modifier"):
        layerwise.compress(model, [GPTQModifier(scheme="W8A16"), SmoothQuantModifier()], dataset=BATCHES,
                           show_progress=False, device="cpu")
    assert count_hooks(model) == 0


@pytest.mark.filterwarnings("ignore:sequential")
def test_a_tower_the_data_never_runs_is_one_warning():
    from layerwise.model_zoo.qwen2_vl import tiny_qwen2_vl

    model = tiny_qwen2_vl()
    modifier = SmoothQuantModifier()
    with pytest.warns(SmoothQuantWarning) as caught:
        layerwise.compress(model, [modifier], dataset=token_batches(vocab=200), show_progress=False, device="cpu")
    (warning,) = [w for w in caught if issubclass(w.category, SmoothQuantWarning)]
    assert str(warning.message).startswith("SmoothQuant: 4 mapping(s) not smoothed (no calibration data reached "
                                           "them): 'model.visual.blocks.0.norm1'")
    assert sorted(modifier.scales) == [f"model.language_model.layers.{i}.{norm}" for i in (0, 1)
                                       for norm in ("input_layernorm", "post_attention_layernorm")]


def test_rescaled_hessians_equal_those_of_the_scaled_inputs():
    # q and k share one Gram (folded every 256 rows, the rest pending), o has its own; q's Hessian is
    # taken by one subscriber before the smoothing and still owed to the other
    def hessians(scale_first: bool) -> dict[tuple[int, str], torch.Tensor]:
        torch.manual_seed(0)
        layers = {name: torch.nn.Linear(8, 4) for name in ("q", "k", "o")}
        s, s_o = torch.rand(8) * 3 + 0.2, torch.rand(8) * 3 + 0.2
        bank, owners = HessianBank(), (GPTQModifier(), GPTQModifier())
        for owner in owners:
            for name, layer in layers.items():
                bank.subscribe(owner, name, layer)
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _ in range(5):
                x, x_o = torch.randn(1, 100, 8, generator=generator), torch.randn(1, 100, 8, generator=generator)
                if scale_first:
                    x, x_o = x / s, x_o / s_o
                layers["q"](x), layers["k"](x), layers["o"](x_o)
        taken = {(0, "q"): bank.take(owners[0], "q")[0]}
        if not scale_first:
            bank.rescale_inputs(["q", "k"], s)
            bank.rescale_inputs(["o"], s_o)
        taken.update({(i, n): bank.take(owners[i], n)[0] for i, n in ((1, "q"), (0, "k"), (1, "k"), (0, "o"), (1, "o"))})
        for owner in owners:
            owner.remove_hooks()
        return taken

    rescaled, direct = hessians(scale_first=False), hessians(scale_first=True)
    for key in [(1, "q"), (0, "k"), (1, "k"), (0, "o"), (1, "o")]:
        torch.testing.assert_close(rescaled[key], direct[key], rtol=1e-5, atol=1e-6, msg=lambda m, k=key: f"{k}: {m}")


def test_a_keyed_mapping_is_read_and_a_malformed_one_shows_both_forms():
    keyed = {"smooth_layer": "re:.*post_attention_layernorm", "balance_layers": ["re:.*gate_proj", "re:.*up_proj"]}
    assert SmoothQuantModifier(mappings=[keyed]).mappings == [[["re:.*gate_proj", "re:.*up_proj"],
                                                                "re:.*post_attention_layernorm"]]
    with pytest.raises(MappingError, match=r"\{smooth_layer: smoothed pattern, balance_layers"):
        SmoothQuantModifier(mappings=[{"balance_layers": ["re:.*q_proj"]}])
