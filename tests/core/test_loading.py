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


def _drop_architectures(folder, replace=None):
    import json

    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config.pop("architectures", None)
    if replace is not None:
        config["architectures"] = replace
    config_file.write_text(json.dumps(config))


def test_a_config_without_architectures_keeps_its_lm_head(tiny_llama_dir, tmp_path):
    from safetensors import safe_open

    from layerwise import compress

    _drop_architectures(tiny_llama_dir)
    assert type(load_model(tiny_llama_dir)).__name__ == "LlamaForCausalLM"
    out = tmp_path / "out"
    compress(str(tiny_llama_dir), "W8A16", output_dir=out, show_progress=False)
    keys = set()
    for file in out.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            keys.update(handle.keys())
    assert "lm_head.weight" in keys


def test_an_unknown_architectures_class_is_chosen_by_the_weights(tiny_llama_dir):
    # an auto_map model names its own class; the built-in one of its model_type must keep the head
    _drop_architectures(tiny_llama_dir, replace=["MyCustomLlamaForCausalLM"])
    assert type(load_model(tiny_llama_dir)).__name__ == "LlamaForCausalLM"


def test_a_base_model_checkpoint_loads_as_the_base_model(tiny_llama, tmp_path):
    tiny_llama.model.save_pretrained(tmp_path / "base")
    _drop_architectures(tmp_path / "base")
    assert type(load_model(tmp_path / "base")).__name__ == "LlamaModel"


def test_head_weights_the_class_would_drop_are_a_named_error(tiny_llama, tmp_path):
    from transformers import LlamaForSequenceClassification

    LlamaForSequenceClassification(tiny_llama.config).save_pretrained(tmp_path / "cls")
    _drop_architectures(tmp_path / "cls", replace=["LlamaForCausalLM"])
    with pytest.raises(ModelLoadError, match=r"score\.weight.*architectures"):
        load_model(tmp_path / "cls")
