"""Pruned models save dense with a sparsity_config that plain transformers loads; old bitmask folders still load."""

import json

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

import layerwise
from layerwise.algorithms.quantization.storage import quantized_modules
from layerwise.algorithms.sparsity import MaskStructure, magnitude_mask, mark_sparse, sparse_modules
from layerwise.algorithms.sparsity.storage import PRUNED_ONLY_KEY
from layerwise.errors import NonFiniteError
from layerwise.host.plugin_manager import registry
from layerwise.plugins.savers.errors import SaveError
from tests.conftest import build_tiny_llama

UNSTRUCTURED, TWO_FOUR = MaskStructure(0, 0), MaskStructure(2, 4)


def prune(model, structure=UNSTRUCTURED, sparsity=0.5, only=None):
    """Zero the smallest weights of every Linear but lm_head (or of those ``only`` matches), and mark them."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head" and (only is None or only in name):
            with torch.no_grad():
                module.weight[magnitude_mask(module.weight, structure, sparsity)] = 0
            mark_sparse(module, structure)
    return model


def save(model, out, **kwargs):
    return registry("savers").get("compressed-tensors")(model, out, **kwargs)


def logits(model, seed=1):
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def tensors(folder):
    return load_file(folder / "model.safetensors")


def quant_config(folder):
    return json.loads((folder / "config.json").read_text())["quantization_config"]


def pruned_only_sparsity(folder):
    """The sparsity_config of a model pruned and not quantized: beside config.json's keys, with no quantization_config
    (compressed-tensors 0.19 writes none for it, and transformers on it fails on one without a config group)."""
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config
    return config[PRUNED_ONLY_KEY]


def true_sparsity(modules):
    zeros = sum(int((m.weight == 0).sum()) for m in modules.values())
    return zeros / sum(m.weight.numel() for m in modules.values())


def write_legacy(folder, model, fmt=None):
    """A folder as layerwise 0.1.0 wrote a pruned, unquantized model: its pruned weights encoded ``sparse-bitmask``
    (``sparse-24-bitmask`` when every pruned layer is 2:4), the sparsity_config's format saying so."""
    from safetensors.torch import save_file

    from layerwise.algorithms.sparsity.bitmask import BITMASK, ENCODERS, SPARSE_24

    pruned = sparse_modules(model)
    fmt = fmt or (SPARSE_24 if all(m.sparsity_structure == TWO_FOUR for m in pruned.values()) else BITMASK)
    save(model, folder)
    state = tensors(folder)
    for name in pruned:
        weight = state.pop(f"{name}.weight")
        state.update({f"{name}.weight.{part}": t for part, t in ENCODERS[fmt](weight).items()})
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    sparsity = {**config.pop(PRUNED_ONLY_KEY), "format": fmt}  # 0.1.0 wrote it in a quantization_config
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                                     "sparsity_config": sparsity}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pruned_model_is_saved_dense_and_loads_in_plain_transformers(tmp_path, dtype):
    from transformers import AutoModelForCausalLM

    model = prune(build_tiny_llama().to(dtype))
    save(model, tmp_path / "out")
    saved = tensors(tmp_path / "out")
    for name, module in sparse_modules(model).items():
        assert torch.equal(saved[f"{name}.weight"], module.weight.detach())  # zeros and all, the model's dtype
    assert not [key for key in saved if key.endswith((".bitmask", ".compressed", ".row_offsets"))]
    assert pruned_only_sparsity(tmp_path / "out")["format"] == "dense"

    expected = dict(model.named_parameters())
    for reloaded in (AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=dtype),
                     layerwise.load_compressed(tmp_path / "out")):
        assert type(reloaded) is type(model) and reloaded.dtype == dtype
        assert all(torch.equal(p, expected[n]) for n, p in reloaded.named_parameters())
        if dtype == torch.float32:  # in bf16 transformers keeps the rotary inv_freq in fp32 on load, .to() did not
            assert torch.equal(logits(reloaded), logits(model))
    marked = layerwise.load_compressed(tmp_path / "out")
    assert {n: m.sparsity_structure for n, m in sparse_modules(marked).items()} == {
        n: UNSTRUCTURED for n in sparse_modules(model)}  # marked again: GPTQ keeps the zeros, a save records them
    via_layerwise = layerwise.load_model(tmp_path / "out")  # what compress(path) and the CLI use
    assert via_layerwise.dtype == dtype and set(sparse_modules(via_layerwise)) == set(sparse_modules(model))
    assert all(torch.equal(p, expected[n]) for n, p in via_layerwise.named_parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_bitmask_folder_of_layerwise_0_1_0_still_loads_exactly(tmp_path, dtype):
    model = prune(build_tiny_llama().to(dtype))
    write_legacy(tmp_path / "old", model)
    reloaded = layerwise.load_compressed(tmp_path / "old")
    assert type(reloaded) is type(model) and reloaded.dtype == dtype
    expected = dict(model.named_parameters())
    assert all(torch.equal(p, expected[n]) for n, p in reloaded.named_parameters())
    assert {n: m.sparsity_structure for n, m in sparse_modules(reloaded).items()} == {
        n: UNSTRUCTURED for n in sparse_modules(model)}
    assert "quantization_config" not in reloaded.config.to_dict()  # nothing quantized: no config left
    via_layerwise = layerwise.load_model(tmp_path / "old")
    assert set(sparse_modules(via_layerwise)) == set(sparse_modules(model))
    assert all(torch.equal(p, expected[n]) for n, p in via_layerwise.named_parameters())


def test_a_two_four_model_says_2_of_4_and_its_old_sparse_24_folder_still_loads(tmp_path):
    model = prune(build_tiny_llama(), TWO_FOUR)
    save(model, tmp_path / "out")
    config = pruned_only_sparsity(tmp_path / "out")
    assert config["format"] == "dense" and config["sparsity_structure"] == "2:4"
    assert config["global_sparsity"] == pytest.approx(0.5, abs=1e-6)
    old = write_legacy(tmp_path / "old", model)
    assert quant_config(old)["sparsity_config"]["format"] == "sparse-24-bitmask"
    up = model.model.layers[0].mlp.up_proj.weight
    assert tuple(tensors(old)["model.layers.0.mlp.up_proj.weight.compressed"].shape) == (up.shape[0], up.shape[1] // 2)
    for folder in (tmp_path / "out", old):
        reloaded = layerwise.load_compressed(folder)
        assert torch.equal(logits(reloaded), logits(model))
        assert {m.sparsity_structure for m in sparse_modules(reloaded).values()} == {TWO_FOUR}


def test_sparsity_config_says_what_was_pruned(tmp_path):
    from compressed_tensors.config import SparsityCompressionConfig

    model = prune(build_tiny_llama(), TWO_FOUR, only="mlp")
    prune(model, UNSTRUCTURED, 0.3, only="q_proj")  # mixed structures: "unstructured"
    pruned = sparse_modules(model)
    save(model, tmp_path / "out")
    sparsity = pruned_only_sparsity(tmp_path / "out")
    assert SparsityCompressionConfig.load_from_registry(sparsity["format"], **sparsity).format == "dense"
    assert sparsity["sparsity_structure"] == "unstructured"
    assert sparsity["targets"] == list(pruned) and len(pruned) == 8  # 3 mlp + q_proj, 2 layers
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert sparsity["ignore"] == [n for n in linears if n not in pruned]
    assert abs(sparsity["global_sparsity"] - true_sparsity(pruned)) < 1e-6


@pytest.mark.parametrize("scheme", [None, "W4A16", "W4A16_ASYM", "W8A16", "W8A8_STATIC", "FP8", "FP8_BLOCK"])
def test_the_saver_s_byte_count_is_what_it_writes(tmp_path, scheme):
    # pruned weights are stored dense: the run summary's size says so (it said ~0.55x when they were bitmasks);
    # quantized ones count exactly their packed words, scales and zero points as written
    from layerwise.testing import token_batches

    saver = registry("savers").get("compressed-tensors")
    model = prune(build_tiny_llama(hidden_size=128, intermediate_size=256), TWO_FOUR)
    if scheme is not None:
        layerwise.compress(model, scheme, dataset=token_batches(2, 16, vocab=128), show_progress=False)
    saver.save(model, tmp_path / "out")
    written = sum(t.numel() * t.element_size() for t in tensors(tmp_path / "out").values())
    assert saver.saved_bytes(model) == written


def test_pruned_and_quantized_model_stays_pack_quantized_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    model = prune(build_tiny_llama(hidden_size=128, intermediate_size=256), TWO_FOUR)
    layerwise.compress(model, "W4A16", output_dir=tmp_path / "out", show_progress=False, device="cpu")
    pruned = sparse_modules(model)
    assert set(quantized_modules(model)) == set(pruned)
    config = quant_config(tmp_path / "out")
    assert config["format"] == "pack-quantized" and config["config_groups"]
    sparsity = config["sparsity_config"]
    assert sparsity["format"] == "dense" and sparsity["sparsity_structure"] == "2:4"
    assert sparsity["targets"] == list(pruned) and sparsity["ignore"] == ["lm_head"]
    assert abs(sparsity["global_sparsity"] - true_sparsity(pruned)) < 1e-6 and sparsity["global_sparsity"] >= 0.5
    saved = tensors(tmp_path / "out")
    assert "model.layers.0.mlp.up_proj.weight_packed" in saved
    assert not [key for key in saved if key.endswith((".bitmask", ".compressed"))]

    expected = logits(model)
    for reloaded in (AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(),
                     layerwise.load_compressed(tmp_path / "out").eval()):
        torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
        weight = reloaded.get_submodule("model.layers.1.mlp.down_proj").weight
        assert torch.equal(weight == 0, model.model.layers[1].mlp.down_proj.weight == 0)  # the zeros are kept


def test_a_pruned_conv1d_is_refused_before_anything_is_written(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    mark_sparse(model.transformer.h[0].attn.c_attn, UNSTRUCTURED)
    with pytest.raises(SaveError, match=r"'transformer.h.0.attn.c_attn' is a transformers Conv1D .* nn.Linear only"):
        save(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_weight_that_is_not_what_its_mark_says_writes_nothing(tmp_path):
    model = prune(build_tiny_llama(), TWO_FOUR)
    module = model.model.layers[1].self_attn.o_proj
    with torch.no_grad():
        module.weight[0, :4] = 1.0  # a run of 4 nonzeros in a layer marked 2:4
    with pytest.raises(SaveError, match=r"'model.layers.1.self_attn.o_proj' is marked 2:4 but 1 run\(s\) of 4 columns "
                                        r"hold fewer than 2 zeros .*row 0, columns 0-3.*MaskStructure\(0, 0\)"):
        save(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_non_finite_pruned_weight_writes_nothing(tmp_path):
    model = prune(build_tiny_llama())
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=r"'model.layers.0.mlp.up_proj.weight'"):
        save(model, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
