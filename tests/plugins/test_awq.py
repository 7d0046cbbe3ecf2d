"""AWQModifier: below round-to-nearest per layer, equal to a plain grid search, exact smoothing, saves."""

from __future__ import annotations

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization.mappings import MappingError, resolve_mappings
from layerwise.algorithms.quantization.smoothing import apply_smoothing
from layerwise.errors import RecipeError
from layerwise.host.recipe import parse_recipe
from layerwise.model_zoo.llama import LLAMA, tiny_llama
from layerwise.plugins.modifiers.awq import AWQFallbackWarning, AWQModifier, InputSample
from layerwise.plugins.modifiers.quantization import QuantizationModifier
from layerwise.testing.modifiers import token_batches

#: input channels every norm of the test model makes 10x larger, as trained LLMs' outlier channels are
OUTLIERS = [5, 21, 42]
RECIPE = "AWQModifier:\n  scheme: W4A16_ASYM\n  group_size: 32\n"


def outlier_llama() -> torch.nn.Module:
    model = tiny_llama()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith("layernorm"):
                module.weight[OUTLIERS] *= 10
    return model


def calibration() -> list[dict[str, torch.Tensor]]:
    return token_batches(8, 32, vocab=256, seed=1)


def held_out() -> list[dict[str, torch.Tensor]]:
    return token_batches(4, 32, vocab=256, seed=2)


def awq(model=None, **fields) -> tuple[torch.nn.Module, AWQModifier]:
    modifier = AWQModifier(group_size=32, **fields)
    model = layerwise.compress(model or outlier_llama(), [modifier], dataset=calibration(), show_progress=False, device="cpu")
    return model, modifier


def mappings():
    return resolve_mappings(tiny_llama(), LLAMA.smoothing_mappings, owner="test").mappings


def inputs_of(model, names, batches) -> dict[str, torch.Tensor]:
    """Each named module's inputs over the batches, as (tokens, width) rows."""
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}

    def record(name):
        return lambda module, args: seen[name].append(args[0].reshape(-1, args[0].shape[-1]))

    handles = [model.get_submodule(n).register_forward_pre_hook(record(n)) for n in names]
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        for handle in handles:
            handle.remove()
    return {n: torch.cat(v) for n, v in seen.items()}


# -- quality: never worse than round-to-nearest ----------------------------------------------------
def test_every_balance_layer_errs_less_than_round_to_nearest_on_held_out_inputs():
    model, modifier = awq()
    rtn = layerwise.compress(outlier_llama(), [QuantizationModifier(scheme="W4A16_ASYM", group_size=32)],
                             show_progress=False, device="cpu")
    original = outlier_llama()
    # norm -> layers mappings: their composite norm(x) -> layer is what each model computes (up -> down
    # has act(gate) between: no such composite; up_proj's outputs, divided by that mapping's scales, are
    # multiplied back before comparing)
    by_norm = [m for m in mappings() if m.smoothed.endswith("layernorm")]
    norm_inputs = inputs_of(original, [m.smoothed for m in by_norm], held_out())
    ratios = {}
    with torch.no_grad():
        for mapping in by_norm:
            x = norm_inputs[mapping.smoothed]  # the norm's input: each model applies its own (smoothed) norm
            for layer in mapping.balance:
                def output(m, layer=layer, norm=mapping.smoothed, x=x):
                    return m.get_submodule(layer)(m.get_submodule(norm)(x))
                target = output(original)
                ours = output(model) * modifier.scales.get(layer, torch.ones(()))
                ratios[layer] = float((ours - target).square().mean() /
                                      (output(rtn) - target).square().mean())
    assert len(ratios) == sum(len(m.balance) for m in by_norm) >= 10
    assert all(r <= 1.0 + 1e-3 for r in ratios.values()), ratios
    assert min(ratios.values()) < 0.7, ratios  # outlier channels: AWQ about halves the error


def test_the_chosen_scales_are_a_plain_grid_search_and_never_worse_than_rtn_on_the_sample():
    model, modifier = awq()
    mapping = mappings()[0]  # layer 0's input_layernorm -> q, k, v: its inputs are the original model's
    original = outlier_llama()
    x = inputs_of(original, [mapping.balance[0]], calibration())[mapping.balance[0]]
    weights = [original.get_submodule(n).weight.detach() for n in mapping.balance]
    scales, alpha, loss, rtn_loss = reference_search(x, weights, group=32, n_grid=20)

    (record,) = [r for r in modifier.summary if r["smoothed"] == mapping.smoothed]
    assert record["method"] == "awq" and record["alpha"] == alpha and record["tokens"] == x.shape[0]
    assert record["loss"] <= record["rtn_loss"] and loss < rtn_loss
    assert record["loss"] == pytest.approx(loss, rel=1e-4) and record["rtn_loss"] == pytest.approx(rtn_loss, rel=1e-4)
    for name, weight in zip(mapping.balance, weights):
        torch.testing.assert_close(model.get_submodule(name).weight, reference_rtn(weight * scales, 32),
                                   rtol=0, atol=1e-6)
    norm = original.get_submodule(mapping.smoothed).weight
    torch.testing.assert_close(model.get_submodule(mapping.smoothed).weight, norm / scales, rtol=1e-6, atol=0)


def reference_search(x, weights, group, n_grid):
    """AWQ's grid search written plainly: duo scaling, int4 asymmetric groups; returns s, alpha, losses."""
    x_mean = x.abs().mean(dim=0)
    relative = []
    for w in weights:
        r = torch.empty_like(w)
        for start in range(0, w.shape[1], group):
            block = w[:, start:start + group].abs()
            r[:, start:start + group] = block / block.amax(dim=1, keepdim=True)
        relative.append(r)
    w_mean = torch.cat(relative).mean(dim=0)

    def loss_of(s):
        total = 0.0
        for w in weights:
            quantized = reference_rtn(w * s, group) / s
            total += float(((x @ w.t() - x @ quantized.t()) ** 2).mean())
        return total

    best_s, best_alpha = torch.ones_like(x_mean), None
    rtn_loss = best_loss = loss_of(best_s)
    for step in range(n_grid):
        alpha = step / n_grid
        s = x_mean.clamp(min=1e-4) ** alpha / w_mean.clamp(min=1e-4) ** (1 - alpha)
        s = s / (s.max() * s.min()).sqrt()
        loss = loss_of(s)
        if loss < best_loss:
            best_s, best_alpha, best_loss = s, alpha, loss
    return best_s, best_alpha, best_loss, rtn_loss


def reference_rtn(w, group):
    """int4 asymmetric round-to-nearest, min-max per group of columns of each row (0 always in range)."""
    out = torch.empty_like(w)
    for start in range(0, w.shape[1], group):
        block = w[:, start:start + group]
        low = block.amin(dim=1, keepdim=True).clamp(max=0)
        high = block.amax(dim=1, keepdim=True).clamp(min=0)
        scale = (high - low) / 15
        zero = torch.round(torch.clamp(-8 - low / scale, -8, 7))
        q = torch.clamp(torch.round(block / scale + zero), -8, 7)
        out[:, start:start + group] = (q - zero) * scale
    return out


# -- exactness: smoothing alone keeps the function ---------------------------------------------------
def test_the_chosen_scales_alone_keep_the_fp32_function():
    model, modifier = awq()
    assert all(r["method"] == "awq" for r in modifier.summary)
    original, smoothed = outlier_llama(), outlier_llama()
    ids = held_out()[0]["input_ids"]
    with torch.no_grad():
        before = original(input_ids=ids).logits
        norms = [m for m in mappings() if m.smoothed.endswith("layernorm")]
        assert len(norms) == 4
        for mapping in norms:  # the scales AWQ folded into each norm, read back from it
            scales = original.get_submodule(mapping.smoothed).weight / model.get_submodule(mapping.smoothed).weight
            assert not torch.allclose(scales, torch.ones_like(scales))
            apply_smoothing(smoothed, mapping, scales)
        after = smoothed(input_ids=ids).logits
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


# -- the pipeline: blocks, per-piece work, a model that saves and reloads ----------------------------
def test_each_piece_frees_its_samples_and_the_block_is_observed_before_smoothing(monkeypatch):
    held: list[set[str]] = []
    epoch_end = AWQModifier.on_sequential_epoch_end

    def recording(self, state, modules):
        epoch_end(self, state, modules)
        held.append(set(self._stats))

    monkeypatch.setattr(AWQModifier, "on_sequential_epoch_end", recording)
    model, modifier = awq()
    assert model.layerwise_report.pipeline == "sequential"
    layer_1 = {m.smoothed for m in mappings() if m.smoothed.startswith("model.layers.1.")}
    assert len(layer_1) >= 2
    assert held[0] == layer_1 and held[1:] == [set()] * (len(held) - 1)
    assert not modifier._stats and not modifier._handles


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_the_preset_and_a_yaml_recipe_save_a_model_that_reloads_to_the_same_outputs(tmp_path):
    from transformers import CompressedTensorsConfig, LlamaForCausalLM

    (preset,) = parse_recipe("AWQ_W4A16_ASYM")
    assert isinstance(preset, AWQModifier)
    assert (preset.args.num_bits, preset.args.symmetric, preset.args.group_size) == (4, False, 128)
    (from_yaml,) = parse_recipe(RECIPE)
    assert from_yaml.args.group_size == 32 and from_yaml.to_dict() == {"AWQModifier": {
        **AWQModifier().to_dict()["AWQModifier"], "group_size": 32}}

    out = tmp_path / "awq"
    model = layerwise.compress(outlier_llama(), RECIPE, dataset=calibration(), output_dir=out, show_progress=False, device="cpu")
    assert (out / "awq_summary.json").is_file()
    # transformers 5 + compressed-tensors 0.20 reload asymmetric group checkpoints (packed zero points)
    # only by dequantizing on load (as in test_compressed_tensors_saver; vllm-project/llm-compressor#1618)
    reloaded = layerwise.load_compressed(out, model_class=LlamaForCausalLM,
                                         quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    ids = held_out()[0]["input_ids"]
    with torch.no_grad():
        assert torch.allclose(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-4, atol=1e-5)


def test_a_mapping_split_over_two_pieces_is_rounded_to_nearest_with_a_warning():
    split = [[["re:.*layers\\.1\\.mlp\\.up_proj"], "re:.*layers\\.0\\.post_attention_layernorm"]]
    with pytest.warns(AWQFallbackWarning, match="model.layers.0.post_attention_layernorm is not smoothed: its "
                                                "layers are in different pieces"):
        model, modifier = awq(tiny_llama(), mappings=split)
    methods = {r["smoothed"]: r["method"] for r in modifier.summary}
    assert methods["model.layers.0.post_attention_layernorm"] == "rtn"
    assert model.model.layers[1].mlp.up_proj.quantization_args.group_size == 32


# -- the sample -----------------------------------------------------------------------------------
def test_the_row_sample_is_bounded_evenly_spaced_and_the_mean_sees_every_token():
    sample = InputSample(limit=16)
    tokens = torch.arange(70, dtype=torch.float32)[:, None].repeat(1, 3)  # row i holds i
    for start in range(0, 70, 7):
        sample.add(tokens[start:start + 7])
    assert sample.stride == 8 and sample.rows()[:, 0].tolist() == [float(i) for i in range(0, 70, 8)]
    assert sample.tokens == 70 and torch.equal(sample.mean(), torch.full((3,), 34.5))


# -- errors ----------------------------------------------------------------------------------------
def test_no_mappings_is_a_named_error(monkeypatch):
    from layerwise.tracing import smoothing_layout

    monkeypatch.setattr(smoothing_layout, "CANDIDATES", ((("re:.*nothing_like_it",), "re:.*input_layernorm"),))
    modifier = AWQModifier(group_size=32)
    with pytest.raises(MappingError, match="AWQModifier: no smoothing mappings: no model patch matches this model, "
                                           "and none was found from the layout of LlamaForCausalLM"):
        layerwise.compress(tiny_llama(), [modifier], dataset=calibration(), show_progress=False, options=layerwise.CompressOptions.of(patch=False), device="cpu")
    with pytest.raises(MappingError, match="AWQModifier.mappings is empty"):
        AWQModifier(mappings=[])
    with pytest.raises(MappingError, match=r"'re:.\*q_prj' match no module"):
        awq(tiny_llama(), mappings=[[["re:.*q_prj"], "re:.*input_layernorm"]])


@pytest.mark.parametrize("fields, match", [
    ({"n_grid": 0}, "AWQModifier.n_grid must be a positive integer, got 0"),
    ({"n_grid": True}, "AWQModifier.n_grid must be a positive integer"),
    ({"search_tokens": 0}, "AWQModifier.search_tokens must be a positive integer"),
    ({"duo_scaling": "yes"}, "AWQModifier.duo_scaling must be true or false"),
])
def test_bad_fields_are_recipe_errors(fields, match):
    with pytest.raises(RecipeError, match=match):
        AWQModifier(**fields)


def test_a_group_size_that_does_not_divide_a_layer_names_the_layer_and_the_fix():
    with pytest.raises(RecipeError, match=r"AWQModifier: group_size 128 does not divide in_features 64 of layer "
                                          r"'model.layers.0.self_attn.q_proj' \(and 11 more: .*\); use strategy: "
                                          r"channel, or group_size 64, or add them to ignore"):
        layerwise.compress(tiny_llama(), "AWQ_W4A16_ASYM", dataset=calibration(), show_progress=False, device="cpu")


def test_llm_compressors_awq_recipe_with_keyed_mappings_is_read():
    from layerwise.host.recipe import parse_recipe

    recipe = """
AWQModifier:
  ignore: [lm_head]
  scheme: W4A16_ASYM
  mappings:
    - smooth_layer: "re:.*input_layernorm$"
      balance_layers: ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]
      activation_hook_target: null
    - {smooth_layer: "re:.*post_attention_layernorm$", balance_layers: ["re:.*gate_proj$", "re:.*up_proj$"]}
"""
    (modifier,) = parse_recipe(recipe)
    assert modifier.mappings == [[["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"], "re:.*input_layernorm$"],
                                 [["re:.*gate_proj$", "re:.*up_proj$"], "re:.*post_attention_layernorm$"]]
