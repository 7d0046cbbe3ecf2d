"""AutoRoundModifier through compress(): blocks tuned on their own outputs, saved, reloaded."""

import json

import pytest
import torch

import layerwise
from layerwise.errors import RecipeError
from layerwise.plugins.modifiers.autoround import STEP_DTYPES, AutoRoundModifier
from layerwise.plugins.modifiers.quantization import QuantizationModifier
from layerwise.recipe import parse_recipe
from tests.conftest import build_tiny_llama


def _samples(count=12, length=16):
    generator = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 128, (1, length), generator=generator)} for _ in range(count)]


def _block_outputs(model, batch):
    outputs = []
    hooks = [layer.register_forward_hook(lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple) else o))
             for layer in model.model.layers]
    with torch.no_grad():
        model(batch, use_cache=False)
    for h in hooks:
        h.remove()
    return outputs


def test_autoround_tunes_every_block_beats_rtn_and_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    model, reference, rtn = build_tiny_llama(), build_tiny_llama(), build_tiny_llama()
    samples = _samples()
    modifier = AutoRoundModifier(scheme="W4A16", num_bits=3, group_size=32, iters=16, batch_size=4)
    out = tmp_path / "autoround"
    model = layerwise.compress(model, modifier, dataset=samples, output_dir=out, show_progress=False, device="cpu")
    assert "blocks" in model.layerwise_report.pieces and "AutoRoundModifier" in model.layerwise_report.pieces
    assert model.layerwise_report.accounting["AutoRound tuning"]["seconds"] > 0  # the summary names the phase
    assert [r["name"] for r in modifier.summary] == ["model.layers.0", "model.layers.1"]
    assert all(len(r["layers"]) == 7 and r["loss"] <= r["rtn_loss"] for r in modifier.summary)
    assert json.loads((out / "autoround_summary.json").read_text()) == modifier.summary
    layerwise.compress(rtn, QuantizationModifier(scheme="W4A16", num_bits=3, group_size=32), show_progress=False)

    batch = torch.cat([s["input_ids"] for s in samples])
    want = _block_outputs(reference, batch)
    got, rounded = _block_outputs(model, batch), _block_outputs(rtn, batch)
    assert float((got[0] - want[0]).pow(2).mean()) < float((rounded[0] - want[0]).pow(2).mean())
    # the stored weights are on the integer grid of their saved scales
    layer = model.model.layers[0].mlp.down_proj
    scale = layer.weight_scale.repeat_interleave(32, dim=1)
    q = layer.weight / scale
    assert torch.allclose(q, q.round(), atol=1e-4) and q.abs().max() <= 4

    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch).logits, model(batch).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("match", ["model", "block"])
def test_blocks_match_the_unquantized_model_or_their_own_unquantized_outputs(match):
    from layerwise.plugins.modifiers import autoround

    model, reference = build_tiny_llama(), build_tiny_llama()
    samples = _samples(count=4)
    seen = {}
    original = autoround.tune_block

    def spy(block, layers, block_samples, **kwargs):
        seen[len(seen)] = [s.target.clone() for s in block_samples]
        return original(block, layers, block_samples, **kwargs)

    autoround.tune_block = spy
    try:
        layerwise.compress(model, AutoRoundModifier(scheme="W4A16", num_bits=2, group_size=32, iters=2, match=match),
                           dataset=samples, show_progress=False, device="cpu")  # compared with CPU outputs
    finally:
        autoround.tune_block = original
    for position in (0, 1):
        want = torch.cat([_block_outputs(reference, s["input_ids"])[position] for s in samples])
        got = torch.cat(seen[position])
        if match == "model" or position == 0:  # block 0's inputs are the embeddings either way
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:  # the unquantized block 1 on what the quantized block 0 gave it
            assert not torch.allclose(got, want, rtol=1e-3, atol=1e-3)


def test_match_model_reads_only_each_block_s_inputs_in_the_observed_run(monkeypatch):
    """With ``match: model`` the targets come from the uncompressed stream, so the observed run of a block
    stops at its inputs after the first batch (the body ran for nothing); ``match: block`` runs it whole."""
    from layerwise.plugins.modifiers import autoround

    def body_runs(match):
        model, captured = build_tiny_llama(), {}
        runs = [0] * len(model.model.layers)
        for index, layer in enumerate(model.model.layers):
            layer.mlp.register_forward_hook(lambda m, a, o, index=index: runs.__setitem__(index, runs[index] + 1))

        def tune_block(block, layers, samples, **kwargs):  # no tuning: only what reached it counts here
            captured[len(captured)] = len(samples)

        monkeypatch.setattr(autoround, "tune_block", tune_block)
        layerwise.compress(model, AutoRoundModifier(scheme="W4A16", group_size=32, iters=1, match=match),
                           dataset=_samples(count=4), show_progress=False)
        return runs, captured

    (model_runs, model_seen), (block_runs, block_seen) = body_runs("model"), body_runs("block")
    assert model_seen == block_seen == {0: 4, 1: 4}  # every batch's sample captured either way
    # match: model adds the reference stream's 4 runs of each block and leaves out 3 of its 4 observed ones
    assert model_runs == [runs + 4 - 3 for runs in block_runs]


def test_autoround_recipe_fields_and_errors():
    (modifier,) = parse_recipe("AutoRoundModifier:\n  scheme: W4A16_ASYM\n  iters: 50\n  lr: 0.01\n  nsamples: 64\n")
    assert isinstance(modifier, AutoRoundModifier) and modifier.iters == 50 and modifier.lr == 0.01
    assert modifier.to_dict()["AutoRoundModifier"]["nsamples"] == 64
    with pytest.raises(RecipeError, match="iters must be an integer"):
        AutoRoundModifier(iters=-1)
    with pytest.raises(RecipeError, match="strategy 'channel' or 'group'"):
        AutoRoundModifier(scheme="FP8_DYNAMIC")
    with pytest.raises(RecipeError, match="weight-only scheme"):
        AutoRoundModifier(scheme="W8A8")
    with pytest.raises(RecipeError, match="match must be one of model, block"):
        AutoRoundModifier(match="layer")
    with pytest.raises(RecipeError, match="compile must be true or false"):
        AutoRoundModifier(compile="yes")
    with pytest.raises(RecipeError, match=r"step_dtype must be null .* bfloat16 \(bf16\) or float16 \(fp16\), got 'fp8'"):
        AutoRoundModifier(step_dtype="fp8")
    (short,) = parse_recipe("AutoRoundModifier:\n  scheme: W4A16\n  step_dtype: bf16\n")
    assert STEP_DTYPES[short.step_dtype] is torch.bfloat16
    with pytest.raises(RecipeError, match="step_dtype must be"):
        AutoRoundModifier(step_dtype=["bfloat16"])


def test_llm_compressor_autoround_recipes_read_with_notes():
    recipe = ("AutoRoundModifier:\n  targets: [Linear]\n  scheme: W4A16\n  ignore: [lm_head]\n  iters: 10\n"
              "  enable_torch_compile: false\n")
    with pytest.warns(UserWarning, match="compile: true"):
        (modifier,) = parse_recipe(recipe)
    assert modifier.iters == 10
    with pytest.raises(RecipeError, match="execution device"):
        parse_recipe("AutoRoundModifier:\n  device_ids: '0,1'\n")


def test_nsamples_caps_the_samples_a_block_is_tuned_on():
    model = build_tiny_llama()
    seen = []
    modifier = AutoRoundModifier(scheme="W4A16", group_size=32, iters=2, nsamples=5)
    original = modifier._tune
    modifier._tune = lambda name: (seen.append(len(modifier._samples[name])), original(name))[1]
    layerwise.compress(model, modifier, dataset=_samples(count=8), show_progress=False)
    assert seen == [5, 5]


def test_a_block_is_tuned_without_its_capture_hook(monkeypatch):
    """The capture hook is removed before its block is tuned (the steps call the block 200 times; a compiled
    step would also trace the hook and recompile for every block's own), and only that block's."""
    from layerwise.plugins.modifiers import autoround

    model = build_tiny_llama()
    counts = []

    def tune_block(block, *args, **kwargs):
        counts.append([len(layer._forward_hooks) + len(layer._forward_pre_hooks) for layer in model.model.layers])
        return original(block, *args, **kwargs)

    original = autoround.tune_block
    monkeypatch.setattr(autoround, "tune_block", tune_block)
    layerwise.compress(model, AutoRoundModifier(scheme="W4A16", group_size=32, iters=1), dataset=_samples(count=4),
                       show_progress=False)
    assert counts == [[0, 1], [0, 0]]  # block 0 tuned without its hook, block 1's still there; then block 1


def test_bfloat16_steps_through_compress_tune_every_block_below_rtn(monkeypatch):
    """step_dtype: bfloat16 reaches the tuner as the dtype the steps are autocast to; every block still beats
    round-to-nearest and the run is reproducible."""
    from layerwise.plugins.modifiers import autoround

    dtypes = []

    def tune_block(*args, **kwargs):
        dtypes.append(kwargs["step_dtype"])
        return original(*args, **kwargs)

    original = autoround.tune_block
    monkeypatch.setattr(autoround, "tune_block", tune_block)
    runs = []
    for _ in range(2):
        modifier = AutoRoundModifier(scheme="W4A16", num_bits=3, group_size=32, iters=8, batch_size=4,
                                     step_dtype="bfloat16")
        model = layerwise.compress(build_tiny_llama(), modifier, dataset=_samples(), show_progress=False)
        assert all(r["method"] == "autoround" and r["loss"] < r["rtn_loss"] for r in modifier.summary)
        runs.append(model.model.layers[1].mlp.down_proj.weight.detach())
    assert dtypes == [torch.bfloat16] * 4 and torch.equal(*runs)


def test_autoround_preset():
    (modifier,) = parse_recipe("AUTOROUND_W4A16")
    assert isinstance(modifier, AutoRoundModifier) and modifier.args.num_bits == 4


def test_a_run_whose_steps_improve_nothing_says_its_output_is_round_to_nearest():
    """One step scores only the start (round-to-nearest): every block keeps it, the summary says 'rtn' and a
    warning says the output is plain round-to-nearest (not a silently wasted AutoRound run)."""
    from layerwise.algorithms.quantization.storage import quantized_modules

    model, rtn = build_tiny_llama(), build_tiny_llama()
    modifier = AutoRoundModifier(scheme="W4A16", group_size=32, iters=1)
    with pytest.warns(UserWarning, match="every block kept round-to-nearest.*1 steps"):
        layerwise.compress(model, modifier, dataset=_samples(count=4), show_progress=False)
    assert [r["method"] for r in modifier.summary] == ["rtn", "rtn"]
    assert all(r["best_step"] == -1 and r["loss"] == r["rtn_loss"] for r in modifier.summary)
    layerwise.compress(rtn, QuantizationModifier(scheme="W4A16", group_size=32), show_progress=False)
    for name in quantized_modules(model):
        assert torch.equal(model.get_submodule(name).weight, rtn.get_submodule(name).weight), name


def test_only_the_schemes_autoround_learns_are_offered_as_presets():
    from layerwise.host.recipe import preset_names

    offered = [name for name in preset_names() if name.startswith("AUTOROUND_")]
    assert "AUTOROUND_W4A16" in offered and "AUTOROUND_W4A16_ASYM" in offered
    assert not [name for name in offered if "FP" in name or "A8" in name]
    for name in offered:
        parse_recipe(name)  # each one offered builds
