"""GPTQModifier on modules and tiny models: RTN equivalence, fallbacks, hooks, compress() end to end."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization import gptq as solver
from layerwise.algorithms.quantization.gptq import accumulate_hessian, gptq_quantize
from layerwise.errors import NonFiniteError, RecipeError
from layerwise.host.lifecycle import Lifecycle
from layerwise.host.pipeline import PipelineOptions
from layerwise.host.plugin_manager import registry
from layerwise.host.recipe import parse_recipe, recipe_to_yaml
from layerwise.host.state import CompressionState
from tests.conftest import build_tiny_llama, make_word_tokenizer
from tests.plugins.pipelines.helpers import make_batches, make_lifecycle


def gptq(**fields):
    return registry("modifiers").get("GPTQModifier")(**fields)


def rtn(**fields):
    return registry("modifiers").get("QuantizationModifier")(**fields)


class TwoLinears(torch.nn.Module):
    def __init__(self, columns=64, out=32, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.first = torch.nn.Linear(columns, columns, bias=False)
        self.second = torch.nn.Linear(columns, out)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def calibrate(model, modifier, batches, pieces=None):
    """initialize -> calibration_start -> forward every batch -> epoch ends -> calibration_end."""
    lifecycle = Lifecycle(CompressionState(model, [modifier]))
    lifecycle.initialize()
    with torch.no_grad(), lifecycle.calibrating():
        for x in batches:
            model(x)
        for piece in pieces or []:
            lifecycle.sequential_epoch_end(piece)
    lifecycle.finalize()
    return lifecycle


def correlated(columns=64, tokens=256, seed=1):
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(columns) + 2 * torch.randn(columns, columns, generator=g) / columns ** 0.5
    return [(torch.randn(tokens, columns, generator=g) @ mix).unsqueeze(0)]


def weights(model):
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


# -- identity Hessian: equal to round-to-nearest ---------------------------------------------------
@pytest.mark.parametrize("fields", [
    dict(scheme="W4A16", strategy="channel"),
    dict(scheme="W4A16", group_size=32),
    dict(scheme="W4A16_ASYM", group_size=16),
    dict(scheme="W8A16"),
    dict(scheme="W8A16", symmetric=False),
    dict(scheme="W4A16", strategy="tensor"),
])
def test_identity_hessian_gives_round_to_nearest_bit_for_bit(fields):
    # inputs are the rows of an identity matrix: H = 2/n I for the layer that sees them
    model = TwoLinears()
    reference = TwoLinears()
    modifier = gptq(targets=["first"], ignore=[], **fields)
    calibrate(model, modifier, [torch.eye(64).unsqueeze(0)])
    calibrate(reference, rtn(targets=["first"], ignore=[], **fields), [])
    assert torch.equal(model.first.weight, reference.first.weight)
    assert torch.equal(model.first.weight_scale, reference.first.weight_scale)
    assert torch.equal(model.first.weight_zero_point, reference.first.weight_zero_point)
    assert modifier.summary[0]["method"] == "gptq" and modifier.summary[0]["tokens"] == 64


# -- real work: better than RTN, equal to the solver ------------------------------------------------
@pytest.mark.parametrize("fields", [dict(scheme="W4A16", group_size=32), dict(scheme="W4A16_ASYM", group_size=32),
                                    dict(scheme="W4A16", strategy="channel"), dict(scheme="W8A16")])
def test_layer_output_error_is_below_round_to_nearest(fields):
    batches = correlated()
    model, reference, original = TwoLinears(), TwoLinears(), TwoLinears()
    calibrate(model, gptq(targets=["first"], ignore=[], **fields), batches)
    calibrate(reference, rtn(targets=["first"], ignore=[], **fields), [])
    x = batches[0][0]
    target = original.first(x)
    err_gptq = (model.first(x) - target).norm() / target.norm()
    err_rtn = (reference.first(x) - target).norm() / target.norm()
    assert err_gptq < 0.9 * err_rtn


def test_modifier_result_is_the_solvers_and_conv1d_is_transposed():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = torch.nn.Sequential(Conv1D(24, 32))  # weight (in=32, out=24)
    original = model[0].weight.detach().clone()
    batches = [torch.randn(1, 40, 32) @ torch.randn(32, 32), torch.randn(1, 30, 32)]
    modifier = gptq(targets=["Conv1D"], ignore=[], scheme="W4A16", group_size=16)
    calibrate(model, modifier, batches)
    h, n = None, 0
    for x in batches:
        h, n = accumulate_hessian(h, n, x)
    expected = gptq_quantize(original.t(), h, modifier.args)
    assert model[0].weight.shape == (32, 24)
    torch.testing.assert_close(model[0].weight.t(), expected.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(model[0].weight_scale, expected.scale, rtol=1e-6, atol=0)
    assert modifier.summary[0]["tokens"] == 70


@pytest.mark.parametrize("lengths", [(7, 9, 5), (300, 270)])  # the second: each input folds at once
def test_layers_reading_the_same_input_share_one_gram_matrix(lengths):
    model = build_tiny_llama()
    modifier = gptq(scheme="W4A16", strategy="channel")
    lifecycle = make_lifecycle(model, modifier)
    inputs: dict[str, list[torch.Tensor]] = {}
    attn = model.model.layers[0].self_attn
    record = {n: getattr(attn, n).register_forward_pre_hook(
        lambda m, a, n=n: inputs.setdefault(n, []).append(a[0].detach().clone())) for n in ("q_proj", "o_proj")}
    lifecycle.calibration_start()
    with torch.no_grad():
        for batch in make_batches(lengths=lengths):
            model(**batch)
    for handle in record.values():
        handle.remove()
    prefix = "model.layers.0.self_attn."
    grams = modifier._grams
    assert grams[prefix + "q_proj"] is grams[prefix + "k_proj"] is grams[prefix + "v_proj"]
    assert grams[prefix + "o_proj"] is not grams[prefix + "q_proj"]
    mlp = "model.layers.0.mlp."
    assert grams[mlp + "gate_proj"] is grams[mlp + "up_proj"] is not grams[mlp + "down_proj"]
    for name in ("q_proj", "o_proj"):
        expected, count = None, 0
        for x in inputs[name]:
            expected, count = accumulate_hessian(expected, count, x)
        hessian, samples = modifier._hessian(prefix + name)
        torch.testing.assert_close(hessian, expected, rtol=1e-5, atol=1e-6)
        assert samples == count == sum(lengths)
    k_hessian, _ = modifier._hessian(prefix + "k_proj")  # still there for the other members
    torch.testing.assert_close(k_hessian, accumulate_hessian(None, 0, torch.cat(inputs["q_proj"], 1))[0],
                               rtol=1e-5, atol=1e-6)
    lifecycle.calibration_end()


@pytest.mark.parametrize("lengths", [(7, 9, 5), (300, 270)])
def test_half_precision_inputs_kept_as_a_gpu_keeps_them_give_the_float32_hessians(lengths, monkeypatch):
    """On a GPU the bank keeps bfloat16 inputs as they are (half the memory) and takes their Gram with float32
    sums (:func:`layerwise.algorithms.hessian.gram_dtype`). Forced here on the CPU: waiting, shared (q/k/v) and
    folded at once, every Hessian is the float32 copies' one."""
    from layerwise.plugins.modifiers import hessians

    monkeypatch.setattr(hessians, "gram_dtype", lambda x: x.dtype)
    model = build_tiny_llama().to(torch.bfloat16)
    modifier = gptq(scheme="W4A16", strategy="channel")
    lifecycle = make_lifecycle(model, modifier)
    inputs: dict[str, list[torch.Tensor]] = {}
    layer = model.model.layers[0]
    names = {"q_proj": layer.self_attn.q_proj, "o_proj": layer.self_attn.o_proj, "down_proj": layer.mlp.down_proj}
    record = [module.register_forward_pre_hook(lambda m, a, n=n: inputs.setdefault(n, []).append(a[0].detach().clone()))
              for n, module in names.items()]
    lifecycle.calibration_start()
    with torch.no_grad():
        for batch in make_batches(lengths=lengths):
            model(**batch)
    for handle in record:
        handle.remove()
    waiting = [x for gram in modifier._grams.values() for x in gram.pending]
    assert all(x.dtype == torch.bfloat16 for x in waiting)
    for name, module in names.items():
        qualified = next(q for q, m in model.named_modules() if m is module)
        expected, count = None, 0
        for x in inputs[name]:
            expected, count = accumulate_hessian(expected, count, x)  # float32 copies
        hessian, samples = modifier._hessian(qualified)
        assert hessian.dtype == torch.float32 and samples == count == sum(lengths)
        torch.testing.assert_close(hessian, expected, rtol=1e-5, atol=1e-5)
    lifecycle.calibration_end()


def test_a_member_whose_inputs_diverge_keeps_its_own_exact_history():
    class Fork(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.a, self.b = torch.nn.Linear(16, 8), torch.nn.Linear(16, 8)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.a(x) + self.b(x if self.calls < 3 else x * 2)  # b's input differs from the third call

    model = Fork()
    modifier = gptq(targets=["a", "b"], ignore=[], scheme="W8A16")
    lifecycle = Lifecycle(CompressionState(model, [modifier]))
    lifecycle.initialize()
    xs = [torch.randn(1, n, 16) for n in (700, 600, 500, 400)]  # large enough to fold in between
    with torch.no_grad(), lifecycle.calibrating():
        for x in xs:
            model(x)
        assert modifier._grams["a"] is not modifier._grams["b"]
        for name, seen in (("a", xs), ("b", xs[:2] + [x * 2 for x in xs[2:]])):
            expected = accumulate_hessian(None, 0, torch.cat(seen, 1))[0]
            hessian, samples = modifier._hessian(name)
            torch.testing.assert_close(hessian, expected, rtol=1e-5, atol=1e-5)
            assert samples == 2200


def test_inputs_wait_for_their_fold_as_copies_unless_the_pipeline_holds_them():
    """A short input waits for more rows before its Gram product. The model may still write into it
    after the hook, so it waits as a copy; inside ``inputs_held_unchanged`` (sequential at layers,
    which shows entry layers their cached inputs) it waits as it is. Both give the input's Hessian."""
    from layerwise.host.pipeline import inputs_are_held, inputs_held_unchanged

    x = correlated(tokens=10)[0]
    expected = accumulate_hessian(None, 0, x)[0]
    assert not inputs_are_held()
    for held in (False, True):
        model = TwoLinears()
        modifier = gptq(targets=["first"], ignore=[], scheme="W8A16")
        lifecycle = Lifecycle(CompressionState(model, [modifier]))
        lifecycle.initialize()
        seen = x.clone()
        with torch.no_grad(), lifecycle.calibrating():
            if held:
                with inputs_held_unchanged():
                    assert inputs_are_held()
                    model.first(seen)
            else:
                model.first(seen)
                seen.mul_(3.0)  # written in place after the hook, before any fold
            waiting = modifier._grams["first"].pending[0]
            shares = waiting.untyped_storage().data_ptr() == seen.untyped_storage().data_ptr()
            assert shares == held
            hessian, samples = modifier._hessian("first")
        torch.testing.assert_close(hessian, expected, rtol=1e-5, atol=1e-6)
        assert samples == 10
    assert not inputs_are_held()


# -- activation order -----------------------------------------------------------------------------
def test_static_actorder_stores_no_group_index_and_saves(tmp_path):
    model = build_tiny_llama()
    modifier = gptq(scheme="W4A16", group_size=32, actorder="static")
    run_pipeline(model, modifier, "sequential")
    layer = model.model.layers[0].mlp.down_proj
    assert layer.quantization_args.actorder == "static" and not hasattr(layer, "weight_g_idx")
    registry("savers").get("compressed-tensors")(model, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert next(iter(config["config_groups"].values()))["weights"]["actorder"] == "weight"


@pytest.mark.parametrize("recipe", [
    {"GPTQModifier": {"scheme": "W4A16", "actorder": "group"}},
    {"GPTQModifier": {"scheme": "W4A16", "actorder": "dynamic"}},
    {"GPTQModifier": {"scheme": {"preset": "W4A16", "actorder": "group"}}},
    {"GPTQModifier": {"config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "group_size": 128, "actorder": "group"}}}}},
])
def test_group_actorder_is_refused_when_the_recipe_is_read_naming_the_alternatives(recipe):
    """As llm-compressor 0.14 does: its group index cannot be saved, so it used to fail only after calibrating."""
    with pytest.raises(RecipeError, match="group activation order") as info:
        parse_recipe(recipe)
    assert "actorder: weight" in str(info.value) and "actorder: null" in str(info.value)


@pytest.mark.parametrize("where", ["modifier", "config group"])
def test_weight_actorder_is_static_on_the_modifier_as_in_a_config_group(where):
    group = {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 128}}
    if where == "config group":
        group["weights"]["actorder"] = "weight"
    fields = {"actorder": "weight"} if where == "modifier" else {}
    (modifier,) = parse_recipe({"GPTQModifier": {**fields, "config_groups": {"group_0": group}}})
    assert modifier.args.actorder == "static" and modifier.actorder == "static"
    assert gptq(actorder="weight").args.actorder == "static"


# -- fallbacks -------------------------------------------------------------------------------------
def test_failed_cholesky_falls_back_to_rtn_with_a_warning_naming_the_layer(monkeypatch, caplog):
    monkeypatch.setattr(solver.torch.linalg, "cholesky_ex", lambda m, upper=False, out=None: (m, torch.tensor(1)))
    model, reference = TwoLinears(), TwoLinears()
    modifier = gptq(ignore=[], scheme="W4A16", group_size=32)
    with pytest.warns(RuntimeWarning, match="'second'.*round.*nearest") as record, caplog.at_level(logging.WARNING):
        calibrate(model, modifier, correlated())
    assert any("'first'" in str(w.message) for w in record)
    assert "'second'" in " ".join(str(w.message) for w in record)
    assert "rounded to nearest" not in caplog.text  # printed once, as a warning, not also logged
    calibrate(reference, rtn(ignore=[], scheme="W4A16", group_size=32), [])
    for name, w in weights(reference).items():
        assert torch.equal(weights(model)[name], w), name
    assert [r["method"] for r in modifier.summary] == ["rtn", "rtn"]


def test_a_layer_whose_every_input_is_nan_is_a_named_error_not_a_nan_hessian():
    model = TwoLinears()
    modifier = gptq(ignore=[], scheme="W4A16", strategy="channel")
    # a NaN reaches the second layer only: it is left out of the Hessian, so none is left
    model.second.register_forward_pre_hook(lambda m, a: (a[0].clone().index_fill_(-1, torch.tensor([3]), torch.nan),))
    lifecycle = Lifecycle(CompressionState(model, [modifier]))
    lifecycle.initialize()
    with torch.no_grad(), lifecycle.calibrating():
        for x in correlated():
            model(x)
        with pytest.raises(NonFiniteError, match="every calibration input of layer 'second'"):
            lifecycle.sequential_epoch_end(["first", "second"])
    assert modifier.summary[0]["name"] == "first" and modifier.summary[0]["method"] == "gptq"


def test_layer_without_data_is_rounded_to_nearest_with_a_warning():
    model = TwoLinears()
    modifier = gptq(ignore=[], scheme="W8A16")
    with pytest.warns(RuntimeWarning, match="'first'.*no calibration data"):
        calibrate(model, modifier, [])
    assert hasattr(model.first, "weight_scale") and hasattr(model.second, "weight_scale")


# -- hooks and memory ------------------------------------------------------------------------------
def hook_count(model):
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_each_piece_frees_its_hessians_and_hooks_as_it_is_quantized():
    model = TwoLinears()
    modifier = gptq(ignore=[], scheme="W8A16")
    lifecycle = Lifecycle(CompressionState(model, [modifier]))
    lifecycle.initialize()
    with torch.no_grad(), lifecycle.calibrating():
        for x in correlated():
            model(x)
        assert set(modifier._grams) == {"first", "second"} and hook_count(model) == 2
        lifecycle.sequential_epoch_end(["first"])
        assert set(modifier._grams) == {"second"} and hook_count(model) == 1
        model(correlated()[0])  # a quantized layer collects nothing more
        assert set(modifier._grams) == {"second"}
    assert hook_count(model) == 0 and not modifier._grams and modifier._last is None


def test_hooks_and_hessians_are_gone_after_an_error_mid_calibration():
    model = build_tiny_llama()
    modifier = gptq(scheme="W4A16", strategy="channel")
    lifecycle = make_lifecycle(model, modifier)
    calls = []

    def boom(module, args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")

    model.model.layers[1].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        registry("pipelines").get("basic")().run(model, make_batches(), lifecycle,
                                                 PipelineOptions(show_progress=False))
    assert hook_count(model) == 1  # only the test's own hook is left
    assert not modifier._grams and modifier._last is None


def test_hooks_are_gone_after_compress_fails(monkeypatch):
    model = build_tiny_llama()
    modifier = gptq(scheme="W4A16", strategy="channel")

    def broken(*args, **kwargs):
        raise RuntimeError("solver exploded")

    monkeypatch.setattr("layerwise.plugins.modifiers.gptq.gptq_quantize", broken)
    with pytest.raises(RuntimeError, match="solver exploded"):
        layerwise.compress(model, modifier, dataset=make_batches(), show_progress=False, device="cpu")
    assert hook_count(model) == 0 and not modifier._grams


# -- through the pipelines and compress() ---------------------------------------------------------
def run_pipeline(model, modifier, pipeline, propagate_error=True, pieces="auto"):
    lifecycle = make_lifecycle(model, modifier)
    options = PipelineOptions(sequential_targets=["LlamaDecoderLayer"], propagate_error=propagate_error,
                              pieces=pieces, show_progress=False)
    registry("pipelines").get(pipeline)().run(model, make_batches(), lifecycle, options)
    lifecycle.finalize()
    return lifecycle


def test_sequential_quantizes_each_layer_when_its_piece_ends():
    model = build_tiny_llama()
    modifier = gptq(scheme="W4A16", group_size=32)
    run_pipeline(model, modifier, "sequential")
    names = [r["name"] for r in modifier.summary]
    assert len(names) == 14 and all(r["method"] == "gptq" for r in modifier.summary)
    # layer 0's modules are quantized (and recorded) before any of layer 1's
    assert max(i for i, n in enumerate(names) if ".layers.0." in n) < min(i for i, n in enumerate(names)
                                                                          if ".layers.1." in n)
    assert all(r["tokens"] == 21 and r["seconds"] >= 0 and r["loss"] >= 0 for r in modifier.summary)


def test_compress_with_a_yaml_recipe_saves_a_model_transformers_reloads(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    model = build_tiny_llama()
    before = weights(model)
    texts = [" ".join(f"w{(i * 7 + j) % 100}" for j in range(40)) for i in range(6)]
    recipe = """
    quant_stage:
      quant_modifiers:
        GPTQModifier:
          scheme: W4A16
          group_size: 32
          ignore: [lm_head]
          block_size: 64
          dampening_frac: 0.02
    """
    out = tmp_path / "gptq"
    with caplog.at_level(logging.INFO, logger="layerwise"):
        model = layerwise.compress(model, recipe, dataset=texts, max_seq_length=32, num_calibration_samples=6, output_dir=out, show_progress=False, options=layerwise.CompressOptions.of(tokenizer=make_word_tokenizer(128)), device="cpu")
    assert model.layerwise_report.pipeline == "sequential"
    after = weights(model)
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert sorted(changed) == sorted(n for n in before if n != "lm_head")
    summary = json.loads((out / "gptq_summary.json").read_text())
    assert len(summary) == 14 and {"name", "loss", "seconds", "tokens", "method"} <= set(summary[0])
    assert all(r["method"] == "gptq" and r["tokens"] > 0 for r in summary)
    assert "GPTQ model.layers.0.self_attn.q_proj: gptq loss" in caplog.text
    saved_recipe = (out / "recipe.yaml").read_text()
    assert "GPTQModifier" in saved_recipe and "dampening_frac: 0.02" in saved_recipe

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-4)


# -- recipes ---------------------------------------------------------------------------------------
def test_unknown_recipe_field_lists_the_gptq_fields():
    with pytest.raises(RecipeError) as info:
        parse_recipe("GPTQModifier:\n  scheme: W4A16\n  damping_frac: 0.1\n")
    message = str(info.value)
    assert "'damping_frac'" in message
    valid = message.split("valid fields:")[1]
    for name in ("dampening_frac", "block_size", "actorder", "scheme", "ignore", "group_size"):
        assert name in valid


@pytest.mark.parametrize("fields, match", [
    (dict(block_size=0), "block_size"),
    (dict(block_size="big"), "block_size"),
    (dict(dampening_frac=-0.1), "dampening_frac"),
    (dict(actorder="dynamic"), "actorder.*static"),
    (dict(actorder="random"), "'random' is not an activation order; valid: static"),
])
def test_bad_fields_are_recipe_errors(fields, match):
    with pytest.raises(RecipeError, match=match):
        gptq(**fields)


def test_recipe_round_trip_and_actorder_from_the_scheme():
    (modifier,) = parse_recipe({"GPTQModifier": {"scheme": "W4A16", "actorder": None, "block_size": 64}})
    assert modifier.args.actorder is None
    (again,) = parse_recipe(recipe_to_yaml([modifier]))
    assert again.actorder is None and again.block_size == 64 and again.args == modifier.args


def test_actorder_defaults_to_static_unless_the_scheme_names_one():
    assert gptq().requires_data and gptq().args.actorder == "static"
    assert gptq(scheme={"preset": "W4A16", "actorder": None}).args.actorder == "static"
    assert gptq(scheme={"preset": "W4A16", "actorder": "static"}, actorder="static").args.actorder == "static"
    assert gptq(scheme={"preset": "W4A16", "actorder": None}, actorder=None).args.actorder is None
    with pytest.raises(RecipeError, match="contradicts"):
        gptq(scheme={"preset": "W4A16", "actorder": "static"}, actorder=None)


def test_an_explicit_static_actorder_is_told_from_the_default():
    """Only the field's default yields to the scheme; ``static`` written is the user's and must agree with it."""
    from layerwise.algorithms.quantization.args import QuantizationArgs, QuantizationScheme

    grouped = QuantizationScheme(weights=QuantizationArgs(num_bits=4, group_size=32, actorder="group"))
    with pytest.raises(RecipeError, match="group activation order"):
        gptq(scheme=grouped)  # the default does not make a removed ordering run
    with pytest.raises(RecipeError, match="group activation order"):
        gptq(scheme=grouped, actorder="static")  # it used to yield to the scheme's, as if not written
    (saved,) = parse_recipe(recipe_to_yaml([gptq(scheme={"preset": "W4A16", "actorder": "static"})]))
    assert saved.actorder == "static" and saved.args.actorder == "static"  # a saved default rebuilds


def test_sequential_skips_the_tail_unless_a_layer_in_it_is_calibrated():
    calls = []
    for ignore in (["lm_head"], []):
        model = build_tiny_llama()
        count = len(ignore)
        handle = model.lm_head.register_forward_pre_hook(  # (tracing runs it on the meta device)
            lambda m, a, n=count: calls.append(n) if a[0].device.type != "meta" else None)
        modifier = gptq(scheme="W4A16", strategy="channel", ignore=ignore)
        run_pipeline(model, modifier, "sequential", pieces="blocks")
        handle.remove()
        assert ("lm_head" in [r["name"] for r in modifier.summary]) == (not ignore)
    assert calls == [0, 0, 0]  # three batches, all for the run that quantizes lm_head


def test_the_last_layer_is_not_re_run_when_the_tail_does_not_run():
    model = build_tiny_llama()
    last_layer = model.model.layers[-1]
    calls = []
    last_layer.register_forward_pre_hook(lambda m, a: calls.append(1) if a[0].device.type != "meta" else None)
    run_pipeline(model, gptq(scheme="W4A16", strategy="channel"), "sequential", pieces="blocks")
    assert len(calls) == 3  # the calibration pass only: its outputs would feed nothing


def test_calibration_forward_ends_after_the_last_input_gptq_reads():
    # the calibration forward's outputs are thrown away (the layer re-runs quantized): it stops at down_proj
    model = build_tiny_llama()
    calls = {"down_proj": [], "post_attention_layernorm": [], "layer_out": []}
    layer = model.model.layers[0]
    real = lambda a: a[0].device.type != "meta"
    layer.mlp.down_proj.register_forward_hook(lambda m, a, o: calls["down_proj"].append(1) if real(a) else None)
    layer.register_forward_hook(lambda m, a, o: calls["layer_out"].append(1) if real(a) else None)
    reference = build_tiny_llama()
    modifier = gptq(scheme="W4A16", strategy="channel")
    run_pipeline(model, modifier, "sequential", pieces="blocks")
    # first batch in full, two stopped before down_proj ran; then the re-run (3 batches)
    assert len(calls["down_proj"]) == 1 + 3 and len(calls["layer_out"]) == 1 + 3
    # and the Hessians are those of the full forward: same result as the basic pipeline without stops
    expected = gptq(scheme="W4A16", strategy="channel")
    run_pipeline(reference, expected, "sequential", propagate_error=False)
    got, want = dict(model.named_parameters()), dict(reference.named_parameters())
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"], want["model.layers.0.mlp.down_proj.weight"])
    assert [r["tokens"] for r in modifier.summary] == [r["tokens"] for r in expected.summary]


def test_long_inputs_of_a_layer_alone_fold_directly_into_the_same_hessian():
    model = TwoLinears()
    modifier = gptq(ignore=[], scheme="W8A16")
    lifecycle = Lifecycle(CompressionState(model, [modifier]))
    lifecycle.initialize()
    xs = [torch.randn(1, n, 64) for n in (300, 40, 500, 260)]  # some fold at once, one waits
    with torch.no_grad(), lifecycle.calibrating():
        for x in xs:
            model(x)
        expected, count = accumulate_hessian(None, 0, torch.cat(xs, 1))
        hessian, samples = modifier._hessian("first")
        torch.testing.assert_close(hessian, expected, rtol=1e-5, atol=1e-5)
        assert samples == count == 1100


class ThreeReaders(torch.nn.Module):
    """q/k/v-like: three Linears of different heights reading one input."""

    def __init__(self, columns=64, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.q, self.k, self.v = (torch.nn.Linear(columns, out, bias=False) for out in (32, 16, 48))

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], dim=-1)


@pytest.mark.parametrize("fields", [dict(scheme="W4A16", group_size=32), dict(scheme="W4A16", strategy="channel"),
                                    dict(scheme="W4A16_ASYM", group_size=16, actorder=None)])
def test_layers_reading_one_input_are_solved_stacked_as_each_alone(fields):
    """One solve for q/k/v (one Hessian) gives each layer what solving it alone with that Hessian gives."""
    model, batches = ThreeReaders(), correlated()
    originals = weights(model)
    modifier = gptq(targets=["Linear"], ignore=[], **fields)
    lifecycle = calibrate(model, modifier, batches)
    h, n = None, 0
    for x in batches:
        h, n = accumulate_hessian(h, n, x)
    assert lifecycle.state.accounting["GPTQ solves"].calls == 1
    for name in ("q", "k", "v"):
        alone = gptq_quantize(originals[name], h, modifier.args)
        torch.testing.assert_close(getattr(model, name).weight, alone.weight, rtol=0, atol=1e-6)
        torch.testing.assert_close(getattr(model, name).weight_scale, alone.scale, rtol=1e-6, atol=0)
    records = {r["name"]: r for r in modifier.summary}
    assert set(records) == {"q", "k", "v"} and all(r["method"] == "gptq" and r["tokens"] == 256 for r in records.values())
    assert records["k"]["loss"] != records["q"]["loss"]  # each layer's own loss, not the stack's


def test_layers_whose_hessians_differ_are_solved_apart(monkeypatch):
    """Stacking needs one Hessian: a member whose matrix differs is solved on its own."""
    model, batches = ThreeReaders(), correlated()
    modifier = gptq(targets=["Linear"], ignore=[], scheme="W4A16", group_size=32)
    take = type(modifier)._take_hessian

    def altered(self, name):
        hessian, samples, dropped = take(self, name)
        return (hessian * 2 if name == "k" else hessian), samples, dropped

    monkeypatch.setattr(type(modifier), "_take_hessian", altered)
    lifecycle = calibrate(model, modifier, batches)
    assert lifecycle.state.accounting["GPTQ solves"].calls == 3
    assert [r["method"] for r in modifier.summary] == ["gptq"] * 3
