"""Calibration data as llm-compressor users have it: chat rows rendered with the chat template, and datasets by
name read from the local datasets cache (never downloaded here), with the errors that say what to do."""

from __future__ import annotations

import json
import sys

import pytest

import layerwise
from layerwise.errors import DatasetError, InvalidArgumentError
from layerwise.model_io.calibration_data import (
    batches_from_records,
    calibration_batches,
    load_records,
)
from layerwise.testing import word_tokenizer
from layerwise.verbs.options import CalibrationOptions
from tests.conftest import build_tiny_llama

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
CHATS = [{"messages": [{"role": "user", "content": "w1 w2 w3"}, {"role": "assistant", "content": "w4 w5"}]},
         {"messages": [{"role": "system", "content": "w6"}, {"role": "user", "content": "w7 w8"}]}]


def tokenizer(template: str | None = TEMPLATE):
    tok = word_tokenizer(128)
    tok.chat_template = template
    return tok


def write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_chat_rows_are_rendered_with_the_tokenizer_s_template(tmp_path):
    tok = tokenizer()
    source = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    batches = calibration_batches(source, tok, num_samples=2, max_seq_length=64, packing="truncate")
    expected = [tok.apply_chat_template(c["messages"], tokenize=False) for c in CHATS]
    assert [b["input_ids"][0].tolist() for b in batches] == [tok(t, return_tensors="pt")["input_ids"][0].tolist()
                                                             for t in expected]
    assert "<user>" in expected[0] and "<assistant>" in expected[0]  # the template's own markers, in the data


def test_chat_template_off_calibrates_on_the_contents_and_on_requires_chat_rows(tmp_path):
    tok = tokenizer(None)  # no template needed when it is off
    batches = calibration_batches(write_jsonl(tmp_path / "chat.jsonl", CHATS), tok, num_samples=1, max_seq_length=64,
                                  chat_template="off")
    ids = batches[0]["input_ids"][0].tolist()
    assert ids[:5] == tok("w1 w2 w3\nw4 w5", add_special_tokens=False)["input_ids"][:5]
    with pytest.raises(DatasetError, match=r"chat_template='on' \(CLI: --chat-template on\) but .* no chat rows"):
        calibration_batches(["w1 w2"], tokenizer(), num_samples=1, max_seq_length=8, chat_template="on")
    with pytest.raises(InvalidArgumentError, match=r"unknown chat_template 'yes'.*auto, on, off \(CLI: --chat-template\)"):
        CalibrationOptions(chat_template="yes")


def test_a_tokenizer_without_a_chat_template_names_the_fix(tmp_path):
    with pytest.raises(DatasetError) as info:
        calibration_batches(write_jsonl(tmp_path / "chat.jsonl", CHATS), tokenizer(None), num_samples=1)
    message = str(info.value)
    assert "holds chat rows (messages) but the tokenizer" in message and "has no chat template" in message
    assert "chat_template='off' (CLI: --chat-template off)" in message and "tokenizer=" in message


def test_a_malformed_chat_row_is_named(tmp_path):
    rows = [CHATS[0], {"messages": [{"content": "no role"}]}]
    with pytest.raises(DatasetError, match=r"calibration row 1 .*'messages' must be a non-empty list of"):
        calibration_batches(write_jsonl(tmp_path / "chat.jsonl", rows), tokenizer(), num_samples=2, packing="truncate")


def test_compress_and_the_cli_calibrate_on_chat_rows(tmp_path, tiny_llama_dir):
    from layerwise.cli import main

    folder = tiny_llama_dir
    tok = tokenizer()
    tok.save_pretrained(folder)  # the model's own tokenizer, with a chat template
    source = write_jsonl(tmp_path / "chat.jsonl", CHATS * 4)
    model = layerwise.compress(str(folder), "GPTQ_W8A16", dataset=str(source), show_progress=False,
                               options=layerwise.CompressOptions.of(max_seq_length=32, chat_template="auto"))
    assert model.layerwise_report.calibration_samples >= 1
    assert main(["compress", "--model", str(folder), "--recipe", "GPTQ_W8A16", "--dataset", str(source),
                 "--chat-template", "on", "--output-dir", str(tmp_path / "out"), "--quiet"]) == 0
    assert (tmp_path / "out" / "config.json").is_file()


# -- datasets by name ------------------------------------------------------------------------------------------
def cache_dataset(monkeypatch, tmp_path, path, rows, config=None, split="train"):
    """Put ``rows`` in a datasets cache under ``tmp_path`` as ``load_dataset(path, config, split=split)`` finds it
    offline (what a first online load leaves), built with datasets' own Json builder."""
    datasets = pytest.importorskip("datasets")
    import shutil

    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.json.json import Json

    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    namespace, name = path.split("/")
    config_name = config or "default"
    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name=camelcase_to_snakecase(name),
                   config_name=config_name, data_files={split: str(source)}, hash="0" * 16)
    builder.download_and_prepare()
    target = cache / f"{namespace}___{camelcase_to_snakecase(name)}" / config_name / "0.0.0" / ("0" * 16)
    shutil.copytree(builder.cache_dir, target)
    info = json.loads((target / "dataset_info.json").read_text())
    (target / "dataset_info.json").write_text(json.dumps({**info, "config_name": config_name}))


PLATYPUS = [{"instruction": "w1 w2", "input": "", "output": "w3 w4"},
            {"instruction": "w5", "input": "w6 w7", "output": "w8"}]


def test_open_platypus_reads_the_local_cache_with_llm_compressor_s_template(tmp_path, monkeypatch):
    cache_dataset(monkeypatch, tmp_path, "garage-bAInd/Open-Platypus", PLATYPUS)
    records = load_records("open_platypus")
    assert len(records) == 2
    assert records[0] == ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\nw1 w2\n\n### Response:\nw3 w4")
    assert "### Input:\nw6 w7" in records[1]
    model = build_tiny_llama()
    layerwise.compress(model, "GPTQ_W8A16", dataset="open_platypus", show_progress=False,
                       options=layerwise.CompressOptions.of(tokenizer=tokenizer(), max_seq_length=16))
    assert model.layerwise_report.calibration_samples >= 1


def test_ultrachat_rows_are_chats_for_the_template(tmp_path, monkeypatch):
    cache_dataset(monkeypatch, tmp_path, "HuggingFaceH4/ultrachat_200k", CHATS, split="train_sft")
    records = load_records("ultrachat_200k")
    assert records[1] == CHATS[1]
    tok = tokenizer()
    batches = batches_from_records(records, tok, num_samples=2, max_seq_length=64, packing="truncate")
    rendered = tok.apply_chat_template(CHATS[1]["messages"], tokenize=False)
    assert rendered.startswith("<system> w6\n<user> w7 w8")
    assert batches[1]["input_ids"][0].tolist() == tok(rendered)["input_ids"]


def test_a_missing_split_or_column_is_named(tmp_path, monkeypatch):
    cache_dataset(monkeypatch, tmp_path, "garage-bAInd/Open-Platypus", [{"instruction": "w1", "answer": "w2"}])
    with pytest.raises(DatasetError) as info:
        load_records("open_platypus")
    assert "split 'train' has no column(s) 'output'" in str(info.value) and "'instruction', 'answer'" in str(info.value)
    with pytest.raises(DatasetError, match=r"dataset 'open_platypus' has no split 'test'.*its default is 'train'"):
        load_records("open_platypus:test")


def test_a_dataset_not_in_the_cache_says_how_to_fetch_it_once(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(DatasetError) as info:
        load_records("gsm8k")  # the suite runs with HF_HUB_OFFLINE=1: nothing is downloaded
    message = str(info.value)
    assert "dataset 'gsm8k' (openai/gsm8k, config 'main', split 'train', column(s) 'question', 'answer')" in message
    assert "is not in the local datasets cache" in message
    assert "datasets.load_dataset('openai/gsm8k', 'main', split='train')" in message


def test_without_the_datasets_package_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DatasetError, match=r"dataset 'open_platypus' \(garage-bAInd/Open-Platypus, split 'train'.*"
                                           r"pip install 'layerwise\[datasets\]'"):
        load_records("open_platypus")


def test_every_name_maps_to_a_path_a_split_and_columns():
    from layerwise.plugins.datasets.named import NAMED_DATASETS, split_name

    assert {"open_platypus", "ultrachat_200k", "gsm8k", "evolcodealpaca", "cnn_dailymail", "wikitext",
            "pile-eval"} <= set(NAMED_DATASETS)
    assert NAMED_DATASETS["ultrachat_200k"].split == "train_sft" and NAMED_DATASETS["ultrachat_200k"].chat
    assert NAMED_DATASETS["gsm8k"].config == "main"
    assert split_name("open_platypus:train[:64]") == ("open_platypus", "train[:64]")
    assert split_name("calib.txt") is None and split_name(["w1"]) is None
