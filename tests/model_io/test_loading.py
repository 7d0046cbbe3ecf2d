import pytest

import layerwise
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


@pytest.mark.parametrize("where", ["./no-such-model", "~/no-such-model", "models/no/such", "no-such-model/",
                                   "/no/such/model"])
def test_a_missing_path_like_model_fails_locally_without_asking_the_hub(where, monkeypatch):
    import huggingface_hub
    import transformers

    def hub_called(*args, **kwargs):
        raise AssertionError(f"{where!r} was looked up on the hub")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for module, name in [(huggingface_hub, "hf_hub_download"), (huggingface_hub, "snapshot_download"),
                         (transformers.AutoConfig, "from_pretrained"), (transformers.AutoTokenizer, "from_pretrained")]:
        monkeypatch.setattr(module, name, hub_called)
    with pytest.raises(ModelLoadError, match="does not exist"):
        layerwise.compress(where, "W8A16")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(where)


def test_a_hub_id_is_not_mistaken_for_a_folder():
    from layerwise.model_io.model_paths import looks_like_path

    assert not looks_like_path("org/model") and not looks_like_path("bert-base-uncased")
    assert looks_like_path("org/model/") and looks_like_path(".") and looks_like_path("a\\b")


def test_trace_of_a_missing_folder_is_a_usage_error(tmp_path, capsys):
    from layerwise.cli import main

    assert main(["trace", "--model", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "unexpected" not in err


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
