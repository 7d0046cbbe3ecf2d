import pytest

from layerwise import load_model
from layerwise.errors import ModelLoadError


def test_load_model_applies_the_llama_patch(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model._layerwise_patch.name == "llama"
    assert not model.training


def test_patching_can_be_disabled_or_forced(tiny_llama_dir):
    assert getattr(load_model(tiny_llama_dir, patch=False), "_layerwise_patch", None) is None
    assert load_model(tiny_llama_dir, patch="bert")._layerwise_patch.name == "bert"


def test_minilm_gets_the_bert_patch(minilm_path):
    model = load_model(minilm_path)
    assert model._layerwise_patch.name == "bert"
    assert model._layerwise_patch.sequential_targets == ("BertLayer",)


def test_bad_paths_are_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(str(tmp_path / "no" / "such" / "model"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
