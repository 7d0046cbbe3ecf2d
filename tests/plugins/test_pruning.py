"""SparseGPTModifier and WandaModifier: recipe errors before any work, exact masks, GPTQ keeping the zeros."""

from __future__ import annotations

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization.storage import quantized_modules
from layerwise.algorithms.sparsity.masks import MaskStructure, magnitude_mask, score_mask
from layerwise.algorithms.sparsity.sparsegpt import sparsegpt_prune
from layerwise.algorithms.sparsity.storage import sparse_modules
from layerwise.errors import RecipeError
from layerwise.host.lifecycle import Lifecycle
from layerwise.host.plugin_manager import registry
from layerwise.host.recipe import parse_recipe
from layerwise.host.state import CompressionState
from tests.conftest import build_tiny_llama
from tests.plugins.pipelines.helpers import make_batches


def modifier(name, **fields):
    return registry("modifiers").get(name)(**fields)


def linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}


def prune_tiny_llama(recipe, output_dir=None, **options):
    model = build_tiny_llama()
    return layerwise.compress(model, recipe, dataset=make_batches(lengths=(16,) * 6), output_dir=output_dir,
                              show_progress=False, options=layerwise.CompressOptions.of(**options))


# -- recipe errors, before any calibration ------------------------------------------------------
@pytest.mark.parametrize("name", ["SparseGPTModifier", "WandaModifier"])
@pytest.mark.parametrize("fields, message", [
    (dict(sparsity=1.0), r"sparsity must be a fraction in \[0, 1\)"),
    (dict(sparsity=-0.2), r"sparsity must be a fraction in \[0, 1\)"),
    (dict(mask_structure="4:2"), r"0 < N < M"),
    (dict(mask_structure="2by4"), r"'0:0' \(unstructured\) or 'N:M'"),
    (dict(mask_structure="2:4", sparsity=0.3), r"contradicts mask_structure '2:4'"),
    (dict(targets=[]), r"targets is empty"),
])
def test_bad_fields_are_named_errors_when_the_recipe_is_read(name, fields, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe({name: fields})


def test_sparsity_defaults_to_half_and_to_what_n_m_implies():
    assert modifier("SparseGPTModifier").fraction == 0.5
    assert modifier("WandaModifier", mask_structure="1:4").fraction == 0.25
    assert modifier("SparseGPTModifier", mask_structure="2:4", sparsity=0.5).fraction == 0.5


class Narrow(torch.nn.Module):
    """A layer 30 columns wide: 2:4 cannot cut it."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 30)
        self.down = torch.nn.Linear(30, 8)
        self.forwards = 0

    def forward(self, x):
        self.forwards += 1
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("name", ["SparseGPTModifier", "WandaModifier"])
def test_n_m_on_a_layer_whose_width_m_does_not_divide_fails_before_calibrating(name):
    model = Narrow()
    lifecycle = Lifecycle(CompressionState(model, parse_recipe({name: {"mask_structure": "2:4"}})))
    with pytest.raises(RecipeError, match=r"layer 'down' has 30 input columns"):
        lifecycle.initialize()  # the first event of a run: no data has flowed
    assert model.forwards == 0


# -- exact masks through compress() -------------------------------------------------------------
def test_sparsegpt_prunes_every_targeted_layer_to_exactly_the_asked_fraction():
    model = prune_tiny_llama({"SparseGPTModifier": {"sparsity": 0.5, "block_size": 16}})
    layers = linears(model)
    assert set(sparse_modules(model)) == set(layers)
    for name, layer in layers.items():
        assert int((layer.weight == 0).sum()) == layer.weight.numel() // 2, name
    records = {r["name"]: r for r in model.layerwise_report.layer_log if r.get("modifier") == "SparseGPTModifier"}
    assert set(records) == set(layers) and {r["method"] for r in records.values()} == {"sparsegpt"}


@pytest.mark.parametrize("name", ["SparseGPTModifier", "WandaModifier"])
def test_two_four_leaves_exactly_two_zeros_in_every_run_of_four(name):
    model = prune_tiny_llama({name: {"mask_structure": "2:4"}})
    for layer_name, layer in linears(model).items():
        runs = (layer.weight == 0).reshape(layer.weight.shape[0], -1, 4).sum(-1)
        assert (runs == 2).all(), layer_name
        assert sparse_modules(model)[layer_name].sparsity_structure == MaskStructure(2, 4)


def test_wanda_prunes_exactly_the_fraction_of_every_row():
    model = prune_tiny_llama({"WandaModifier": {"sparsity": 0.3}})
    # scored on each block's unpruned inputs: the cut stays at blocks, and says why
    assert model.layerwise_report.pieces.startswith("blocks")
    assert "WandaModifier observes each block before compressing any of its layers" in model.layerwise_report.pieces
    for name, layer in linears(model).items():
        per_row = (layer.weight == 0).sum(dim=1)
        assert (per_row == int(0.3 * layer.weight.shape[1] + 0.5)).all(), name


def test_wanda_with_pieces_layers_is_an_error_that_says_why():
    from layerwise.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="WandaModifier observes each block"):
        prune_tiny_llama({"WandaModifier": {"sparsity": 0.5}}, pieces="layers")


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first = torch.nn.Linear(32, 32, bias=False)
        self.second = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def test_wanda_keeps_the_weights_with_the_largest_magnitude_times_input_norm():
    model, reference = TwoLinears(), TwoLinears()
    batches = wanda_on_plain_forwards(model, seed=2, count=3, tokens=20)
    x = torch.cat(batches, 1).reshape(-1, 32)
    assert_wanda_masks(model, reference, {"first": x, "second": torch.relu(reference.first(x))})


def wanda_on_plain_forwards(model, seed, count, tokens):
    """Wanda at 50 % on ``model`` through plain forwards (every layer sees the dense inputs); the batches."""
    g = torch.Generator().manual_seed(seed)
    batches = [torch.randn(1, tokens, 32, generator=g) * torch.linspace(0.1, 4, 32) for _ in range(count)]
    lifecycle = Lifecycle(CompressionState(model, [modifier("WandaModifier", sparsity=0.5, ignore=[])]))
    lifecycle.initialize()
    with torch.no_grad(), lifecycle.calibrating():
        for x in batches:
            model(x)
    return batches


def assert_wanda_masks(model, reference, inputs):
    """Each layer's zeros are the lowest ``|W| * ||X||`` of its row, ``X`` its calibration inputs."""
    for name, x in inputs.items():
        w = getattr(reference, name).weight.detach()
        expected = score_mask(w.abs() * x.norm(dim=0), MaskStructure(0, 0), 0.5)
        assert torch.equal(getattr(model, name).weight == 0, expected), name


class SharedInput(torch.nn.Module):
    """q/k/v-like layers reading one tensor, which is then written in place before a fourth reads it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.q, self.k, self.v, self.after = (torch.nn.Linear(32, 8, bias=False) for _ in range(4))

    def forward(self, x):
        h = x * 1.0
        out = self.q(h) + self.k(h) + self.v(h)
        h.mul_(torch.linspace(3, 0.1, 32))  # same tensor, new contents: its sums must be taken again
        return out.sum() + self.after(h)


def test_wanda_sums_an_input_once_for_the_layers_reading_it_and_again_after_an_in_place_write(monkeypatch):
    from layerwise.plugins.modifiers import wanda as wanda_module

    sums = []
    monkeypatch.setattr(wanda_module, "is_finite", lambda t: sums.append(t.shape) or bool(torch.isfinite(t).all()))
    model, reference = SharedInput(), SharedInput()
    batches = wanda_on_plain_forwards(model, seed=5, count=2, tokens=12)
    assert len(sums) == 2 * len(batches)  # per batch: q/k/v's input once, the written one once
    x = torch.cat(batches, 1).reshape(-1, 32)
    assert_wanda_masks(model, reference, {"q": x, "k": x, "v": x, "after": x * torch.linspace(3, 0.1, 32)})

# -- sparse, then quantized ---------------------------------------------------------------------
@pytest.mark.parametrize("true_sequential, pieces", [(True, "layers"), (False, "blocks")])
def test_gptq_after_sparsegpt_keeps_every_pruned_weight_at_zero(monkeypatch, true_sequential, pieces):
    masks = {}
    cls = registry("modifiers").get("SparseGPTModifier")
    original = cls.prune_module

    def recording(self, name, module, state=None):
        original(self, name, module, state)
        masks[name] = (module.weight == 0).clone()

    monkeypatch.setattr(cls, "prune_module", recording)
    recipe = [{"SparseGPTModifier": {"mask_structure": "2:4", "true_sequential": true_sequential}},
              {"GPTQModifier": {"scheme": "W4A16_ASYM", "group_size": 32}}]
    model = prune_tiny_llama(recipe, pieces=pieces)
    layers = linears(model)
    assert set(masks) == set(layers) == set(quantized_modules(model)) == set(sparse_modules(model))
    for name, layer in layers.items():
        assert (layer.weight[masks[name]] == 0).all(), name


def test_rtn_after_wanda_keeps_the_zeros_too():
    model = prune_tiny_llama([{"WandaModifier": {"sparsity": 0.5}}, {"QuantizationModifier": {"scheme": "W4A16_ASYM",
                                                                                            "group_size": 32}}])
    for name, layer in linears(model).items():
        assert int((layer.weight == 0).sum()) >= layer.weight.numel() // 2, name


# -- on a trained layer: SparseGPT beats magnitude and Wanda --------------------------------------
@pytest.mark.parametrize("structure", [MaskStructure(0, 0), MaskStructure(2, 4)])
def test_sparsegpt_has_a_lower_output_error_than_magnitude_and_wanda_on_trained_layers(minilm_path, structure):
    from layerwise.model_io.loading import load_model, load_tokenizer

    model, tokenizer = load_model(minilm_path), load_tokenizer(minilm_path)
    names = ["encoder.layer.1.attention.self.query", "encoder.layer.3.intermediate.dense",
             "encoder.layer.3.output.dense"]
    inputs = {}
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: inputs.setdefault(n, []).append(a[0].reshape(-1, a[0].shape[-1]))) for n in names]
    sentences = [f"Layer {i} of the model compresses its weights with sample number {i * 7} today."
                 for i in range(24)]
    with torch.no_grad():
        model(**tokenizer(sentences, return_tensors="pt", padding=True))
    for handle in handles:
        handle.remove()
    for name in names:
        x = torch.cat(inputs[name]).to(torch.float32)
        w = model.get_submodule(name).weight.detach().to(torch.float32)
        hessian = 2 * x.t() @ x / x.shape[0]

        def error(pruned, x=x, w=w):
            return float(((pruned - w) @ x.t()).norm() / (w @ x.t()).norm())

        sparsegpt = error(sparsegpt_prune(w, hessian, structure, 0.5).weight)
        magnitude = error(w.masked_fill(magnitude_mask(w, structure, 0.5), 0.0))
        wanda = error(w.masked_fill(score_mask(w.abs() * x.norm(dim=0), structure, 0.5), 0.0))
        assert sparsegpt < wanda < magnitude or sparsegpt < min(wanda, magnitude), (name, sparsegpt, wanda, magnitude)
        assert sparsegpt < min(wanda, magnitude)


# -- saved and loaded back -------------------------------------------------------------------------
@pytest.mark.parametrize("recipe, structure, summary_file", [
    ({"SparseGPTModifier": {"sparsity": 0.5}}, "unstructured", "sparsegpt_summary.json"),
    ({"WandaModifier": {"mask_structure": "2:4"}}, "2:4", "wanda_summary.json"),
])
def test_a_pruned_run_saves_a_folder_plain_transformers_reloads_to_the_same_outputs(tmp_path, recipe, structure,
                                                                                     summary_file):
    import json

    from transformers import AutoModelForCausalLM

    out = tmp_path / "pruned"
    model = prune_tiny_llama(recipe, output_dir=out)
    config = json.loads((out / "config.json").read_text())["layerwise_sparsity_config"]  # no quantization_config
    assert config["format"] == "dense" and config["sparsity_structure"] == structure
    assert abs(config["global_sparsity"] - 0.5) < 1e-6
    summary = out / summary_file
    assert {r["name"] for r in json.loads(summary.read_text())} == set(linears(model))

    def weights_bytes(folder):
        return sum(p.stat().st_size for p in folder.glob("*.safetensors"))

    report = model.layerwise_report  # the summary's size is the saved one: pruned weights are stored dense
    assert abs(report.bytes_after - weights_bytes(out)) < 0.05 * weights_bytes(out)  # + the file header
    assert sorted(report.compressed_modules) == sorted(linears(model))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    for reloaded in (AutoModelForCausalLM.from_pretrained(out), layerwise.load_compressed(out)):
        with torch.no_grad():
            assert torch.equal(reloaded(ids).logits, model(ids).logits)


# -- OWL: a sparsity per block -----------------------------------------------------------------------
def test_owl_prunes_the_block_with_outliers_least_and_keeps_the_mean_sparsity():
    model = build_tiny_llama(num_hidden_layers=4)
    with torch.no_grad():  # block 2 gets outlier weights: a few columns 40x larger
        for layer in (model.model.layers[2].self_attn.q_proj, model.model.layers[2].mlp.up_proj):
            layer.weight[:, :6] *= 40
    recipe = parse_recipe({"SparseGPTModifier": {"sparsity": 0.5, "owl_m": 5, "owl_lmbda": 0.08}})
    model = layerwise.compress(model, recipe, dataset=make_batches(lengths=(16,) * 4), show_progress=False, device="cpu")
    chosen = recipe[0].layer_sparsity
    per_block = {i: chosen[f"model.layers.{i}.self_attn.q_proj"] for i in range(4)}
    assert min(per_block, key=per_block.get) == 2
    assert max(per_block.values()) - per_block[2] == pytest.approx(2 * 0.08, abs=1e-9)  # the spread is 2 lmbda
    assert sum(per_block.values()) / 4 == pytest.approx(0.5, abs=1e-9)
    for name, layer in linears(model).items():  # each layer pruned to its block's share, exactly
        assert int((layer.weight == 0).sum()) == int(chosen[name] * layer.weight.numel() + 0.5), name


@pytest.mark.parametrize("fields, message", [
    (dict(owl_m=5), r"both owl_m .* and owl_lmbda"),
    (dict(owl_m=5, owl_lmbda=0.3), r"owl_lmbda must be in \[0, 0.25\)"),
    (dict(owl_m=0, owl_lmbda=0.08), r"owl_m must be a number > 0"),
    (dict(owl_m=5, owl_lmbda=0.08, mask_structure="2:4"), r"OWL chooses a sparsity per block"),
])
def test_bad_owl_fields_are_named_errors(fields, message):
    with pytest.raises(RecipeError, match=message):
        parse_recipe({"SparseGPTModifier": fields})


def test_wanda_scores_the_first_block_on_the_dense_model_s_inputs():
    batches = make_batches(lengths=(16,) * 6)
    dense = build_tiny_llama()
    inputs = {}
    block = dense.model.layers[0]
    layers = {n: m for n, m in block.named_modules() if isinstance(m, torch.nn.Linear)}
    handles = [m.register_forward_pre_hook(lambda mod, a, n=n: inputs.setdefault(n, []).append(a[0][0]))
               for n, m in layers.items()]
    with torch.no_grad():
        for batch in batches:
            dense(**batch)
    for handle in handles:
        handle.remove()
    pruned = layerwise.compress(build_tiny_llama(), {"WandaModifier": {"sparsity": 0.5}}, dataset=batches,
                                show_progress=False, device="cpu")
    for name, layer in layers.items():  # o_proj and down_proj too: read after q/k/v and gate/up, unpruned
        x = torch.cat(inputs[name])
        expected = score_mask(layer.weight.abs() * x.norm(dim=0), MaskStructure(0, 0), 0.5)
        assert torch.equal(pruned.model.layers[0].get_submodule(name).weight == 0, expected), name


def test_wanda_true_sequential_cuts_at_layers_and_scores_on_the_pruned_model():
    model = prune_tiny_llama({"WandaModifier": {"sparsity": 0.5, "true_sequential": True}})
    assert model.layerwise_report.pieces.startswith("layers")
    dense_scored = prune_tiny_llama({"WandaModifier": {"sparsity": 0.5}})
    o_proj = "model.layers.0.self_attn.o_proj"  # read after v_proj: pruned v_proj outputs change its scores
    assert not torch.equal(model.get_submodule(o_proj).weight == 0, dense_scored.get_submodule(o_proj).weight == 0)
    q_proj = "model.layers.0.self_attn.q_proj"  # the block's first layer reads the same input either way
    assert torch.equal(model.get_submodule(q_proj).weight == 0, dense_scored.get_submodule(q_proj).weight == 0)


def test_sparsegpt_calibrates_a_block_on_its_unpruned_inputs_unless_true_sequential():
    paper = prune_tiny_llama({"SparseGPTModifier": {"sparsity": 0.5}})
    assert paper.layerwise_report.pieces.startswith("blocks")
    layered = prune_tiny_llama({"SparseGPTModifier": {"sparsity": 0.5, "true_sequential": True}})
    assert layered.layerwise_report.pieces.startswith("layers")
    q_proj = "model.layers.0.self_attn.q_proj"  # the block's first layer reads the same input either way
    assert torch.equal(paper.get_submodule(q_proj).weight, layered.get_submodule(q_proj).weight)
    o_proj = "model.layers.0.self_attn.o_proj"  # reads v_proj's output: pruned or not
    assert not torch.equal(paper.get_submodule(o_proj).weight, layered.get_submodule(o_proj).weight)


def test_sparsegpt_true_sequential_must_be_a_bool():
    with pytest.raises(RecipeError, match="true_sequential must be true or false"):
        parse_recipe({"SparseGPTModifier": {"true_sequential": "yes"}})


def test_sparsegpt_then_gptq_share_one_gram_per_input(monkeypatch):
    from layerwise.plugins.modifiers import hessians

    products = []
    original = hessians._add_gram
    monkeypatch.setattr(hessians, "_add_gram", lambda gram, x, flops: (products.append(x.shape), original(gram, x, flops)))
    prune_tiny_llama({"SparseGPTModifier": {"mask_structure": "2:4"}})
    alone = list(products)
    products.clear()
    recipe = parse_recipe([{"SparseGPTModifier": {"mask_structure": "2:4"}},
                           {"GPTQModifier": {"scheme": "W4A16", "group_size": 32}}])
    model = prune_tiny_llama(recipe)
    assert products == alone  # the same Gram products: none computed a second time for GPTQ
    sparsegpt, gptq = ({r["name"]: r["tokens"] for r in m.summary} for m in recipe)
    assert sparsegpt == gptq and len(sparsegpt) == 14
    assert "GPTQ Hessians" not in model.layerwise_report.accounting  # timed once, under SparseGPT's


@pytest.mark.parametrize("poison", [torch.nan, torch.inf, 1e20])  # 1e20 is finite, but its square overflows
def test_wanda_leaves_out_an_input_that_is_not_finite_or_whose_square_overflows(poison):
    from layerwise.runtime.finite import NonFiniteSampleWarning
    from tests.plugins.test_gptq import TwoLinears, calibrate

    g = torch.Generator().manual_seed(3)
    good = [torch.randn(1, 32, 64, generator=g) for _ in range(3)]
    bad = good[1].clone()
    bad[0, 5, 7] = poison
    reference, model = TwoLinears(), TwoLinears()
    calibrate(reference, modifier("WandaModifier", ignore=[]), [good[0], good[2]], pieces=[["first", "second"]])
    wanda = modifier("WandaModifier", ignore=[])
    with pytest.warns(NonFiniteSampleWarning, match=r"layer 'first': 1 calibration input\(s\) held NaN or inf and were left out "
                                                       r"of its input norms"):
        calibrate(model, wanda, [good[0], bad, good[2]], pieces=[["first", "second"]])
    assert torch.equal(model.first.weight, reference.first.weight)  # as if the bad sample had not been there
    assert [r.get("non_finite_inputs") for r in wanda.summary if r["name"] == "first"] == [1]


# -- targets naming blocks, as llm-compressor's pruners take them ---------------------------------
def resolved(name, **fields):
    """The layers a pruning modifier would prune in a tiny Llama (resolved as a run starts, no data)."""
    model = build_tiny_llama()
    state = CompressionState(model, [modifier(name, **fields)], ignore=["lm_head"])
    return set(state.modifiers[0].resolve_modules(state)), model


@pytest.mark.parametrize("name", ["SparseGPTModifier", "WandaModifier"])
@pytest.mark.parametrize("targets", [[r"re:model.layers.\d*$"], ["LlamaDecoderLayer"], "__ALL__", ["__ALL__"]])
def test_a_target_naming_blocks_prunes_the_linear_layers_inside_them(name, targets):
    """llm-compressor's 2:4 example form; it was refused, blaming an ignore list that ignored nothing."""
    layers, model = resolved(name, targets=targets, mask_structure="2:4")
    assert layers == set(linears(model))


def test_a_block_target_keeps_the_ignore_list_and_can_name_one_part():
    layers, _ = resolved("SparseGPTModifier", targets=["re:.*self_attn"], ignore=[r"re:.*o_proj"])
    assert layers == {f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkv"}
