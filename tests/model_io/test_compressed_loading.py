"""load_compressed: old bitmask folders decoded (sharded too), everything else plain from_pretrained, named errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import layerwise
from layerwise.algorithms.sparsity import sparse_modules
from layerwise.errors import ModelLoadError
from layerwise.model_io.compressed_loading import dense_config, sparse_format
from tests.conftest import build_tiny_llama
from tests.plugins.savers.test_sparse_saving import logits, prune, write_legacy

UP = "model.layers.0.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def pruned():
    return prune(build_tiny_llama())


@pytest.fixture
def sparse_dir(tmp_path, pruned):
    """A pruned model's folder as layerwise 0.1.0 wrote it (sparse-bitmask)."""
    return write_legacy(tmp_path / "sparse", pruned)


def read(folder, name="model.safetensors"):
    return load_file(folder / name)


def test_a_sharded_folder_with_parts_in_two_shards_loads(sparse_dir, pruned):
    tensors = read(sparse_dir)
    first = {k: v for k, v in tensors.items() if k.startswith("model.layers.0.") and not k.endswith(".bitmask")}
    second = {k: v for k, v in tensors.items() if k not in first}
    (sparse_dir / "model.safetensors").unlink()
    save_file(first, str(sparse_dir / "model-00001-of-00002.safetensors"), metadata={"format": "pt"})
    save_file(second, str(sparse_dir / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    (sparse_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert torch.equal(logits(layerwise.load_compressed(sparse_dir)), logits(pruned))


def test_a_folder_that_is_not_sparse_is_plain_from_pretrained(tiny_llama_dir):
    from transformers import LlamaForCausalLM

    model = layerwise.load_compressed(tiny_llama_dir, dtype=torch.float32)
    assert torch.equal(logits(model), logits(LlamaForCausalLM.from_pretrained(tiny_llama_dir)))
    assert not sparse_modules(model)
    _, info = layerwise.load_compressed(tiny_llama_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_the_model_class_can_be_chosen(sparse_dir):
    from transformers import AutoModel, LlamaModel

    for cls in (LlamaModel, AutoModel):  # an Auto class is resolved: from_pretrained(None, ...) needs a real one
        model = layerwise.load_compressed(sparse_dir, model_class=cls)
        assert type(model) is LlamaModel and len(sparse_modules(model)) == 14


def test_the_config_loses_only_its_sparse_part():
    from transformers import LlamaConfig

    quantized = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {}},
                 "sparsity_config": {"format": "sparse-bitmask"}}
    config = LlamaConfig(quantization_config=quantized)
    assert sparse_format(config) == "sparse-bitmask" and sparse_format(LlamaConfig()) is None
    assert "sparsity_config" not in dense_config(config).quantization_config
    assert config.quantization_config["sparsity_config"]  # a copy was changed, not the caller's config
    sparse_only = LlamaConfig(quantization_config={**quantized, "config_groups": {}})
    assert not hasattr(dense_config(sparse_only), "quantization_config")


def test_missing_folder_and_config_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        layerwise.load_compressed(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="has no config.json"):
        layerwise.load_compressed(tmp_path / "empty")


def test_a_missing_part_names_the_tensor_and_the_fix(sparse_dir):
    tensors = read(sparse_dir)
    del tensors[f"{UP}.bitmask"]
    save_file(tensors, str(sparse_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"stores '{UP}' as sparse-bitmask but lacks '{UP}.bitmask' .*"
                                             r"model.safetensors.*incomplete"):
        layerwise.load_compressed(sparse_dir)
    with pytest.raises(ModelLoadError, match=rf"lacks '{UP}.bitmask'"):
        layerwise.load_model(sparse_dir)


def test_parts_that_disagree_name_the_tensor(sparse_dir):
    tensors = read(sparse_dir)
    tensors[f"{UP}.row_offsets"] = torch.zeros_like(tensors[f"{UP}.row_offsets"])
    save_file(tensors, str(sparse_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"tensors of '{UP}' .* row_offsets do not match .* damaged"):
        layerwise.load_compressed(sparse_dir)


def test_a_missing_shard_is_named(sparse_dir):
    (sparse_dir / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {UP: "model-00002-of-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match="model-00002-of-00002.safetensors"):
        layerwise.load_compressed(sparse_dir)


def test_quantized_bitmask_folders_are_refused(sparse_dir):
    path = sparse_dir / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"]["config_groups"] = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4}}}
    path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantized and stored as sparse-bitmask"):
        layerwise.load_compressed(sparse_dir)


def test_packed_asymmetric_folders_load_dequantized_with_the_same_outputs(tmp_path):
    # transformers + compressed-tensors 0.20 load packed asymmetric layers only dequantized: layerwise writes
    # "dequantize": true, and load_compressed asks for it by itself for older folders without it
    import warnings

    import layerwise
    from layerwise.plugins.modifiers.quantization import QuantizationModifier
    from layerwise.plugins.savers.compressed_tensors import save_compressed
    from layerwise.testing import token_batches
    from tests.conftest import build_tiny_llama

    model = build_tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        layerwise.compress(model, [QuantizationModifier(scheme="W4A16_ASYM", group_size=32)], show_progress=False, device="cpu")
    save_compressed(model, tmp_path / "out")
    config_path = tmp_path / "out" / "config.json"
    config = json.loads(config_path.read_text())
    del config["quantization_config"]["dequantize"]  # as layerwise 0.1.0 wrote it
    config_path.write_text(json.dumps(config))
    reloaded = layerwise.load_compressed(tmp_path / "out", model_class=type(model)).eval()
    batch = token_batches(1, 16, vocab=128)[0]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(**batch).logits, model(**batch).logits, rtol=0, atol=1e-6)
