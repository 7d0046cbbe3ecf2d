import json

import pytest
import torch

from layerwise.errors import DatasetError
from layerwise.model_io.calibration_data import calibration_batches
from tests.conftest import make_word_tokenizer


@pytest.fixture
def tokenizer():
    return make_word_tokenizer(64)


def test_texts_are_chunked_into_windows(tokenizer):
    texts = [" ".join(f"w{i % 50}" for i in range(30))] * 4  # 4 x (30 words + eos) = 124 tokens
    batches = calibration_batches(texts, tokenizer, num_samples=10, max_seq_length=32, packing="chunk")
    assert [b["input_ids"].shape for b in batches] == [torch.Size([1, 32])] * 3 + [torch.Size([1, 28])]
    assert all(torch.equal(b["attention_mask"], torch.ones_like(b["input_ids"])) for b in batches)


def test_num_samples_caps_the_batches(tokenizer):
    batches = calibration_batches(["w1 w2 w3"] * 50, tokenizer, num_samples=5, max_seq_length=2)
    assert len(batches) == 5


def test_truncate_packing_keeps_one_sample_per_text(tokenizer):
    batches = calibration_batches(["w1 w2 w3 w4", "w5"], tokenizer, num_samples=9, max_seq_length=3,
                                  packing="truncate")
    assert [b["input_ids"].shape[-1] for b in batches] == [3, 1]


def test_text_file_paragraphs_and_jsonl(tmp_path, tokenizer):
    txt = tmp_path / "calib.txt"
    txt.write_text("w1 w2\nw3\n\nw4 w5\n")
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t}) for t in ["w1 w2 w3", "w4"]))
    a = calibration_batches(str(txt), tokenizer, num_samples=9, max_seq_length=64, packing="truncate")
    b = calibration_batches(str(jsonl), tokenizer, num_samples=9, max_seq_length=64, packing="truncate")
    assert [x["input_ids"].shape[-1] for x in a] == [3, 2]
    assert [x["input_ids"].shape[-1] for x in b] == [3, 1]


def test_tokenized_samples_pass_through():
    samples = [{"input_ids": torch.arange(10), "attention_mask": torch.ones(10, dtype=torch.long)}]
    (batch,) = calibration_batches(samples, None, num_samples=4, max_seq_length=6)
    assert torch.equal(batch["input_ids"], torch.arange(6).unsqueeze(0))


def test_datasets_dataset_text_column(tokenizer):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": ["w1 w2", "w3"]})
    batches = calibration_batches(ds, tokenizer, num_samples=9, max_seq_length=8, packing="truncate")
    assert len(batches) == 2


@pytest.mark.parametrize("source", [[], "empty.txt"])
def test_empty_dataset_is_a_clear_error(tmp_path, tokenizer, source):
    if source == "empty.txt":
        source = tmp_path / "empty.txt"
        source.write_text("\n\n")
        source = str(source)
    with pytest.raises(DatasetError, match="empty"):
        calibration_batches(source, tokenizer)


def test_missing_file_and_unknown_kind_are_named(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="nope.txt"):
        calibration_batches(str(tmp_path / "nope.txt"), tokenizer)
    with pytest.raises(DatasetError, match="no dataset loader understands 42"):
        calibration_batches(42, tokenizer)


def test_text_without_tokenizer_says_what_to_pass():
    with pytest.raises(DatasetError, match="tokenizer"):
        calibration_batches(["hello"], None)


def test_image_and_audio_batches_pass_through_whole():
    from layerwise.model_io.calibration_data import calibration_batches

    image = {"input_ids": torch.arange(40).reshape(1, 40), "pixel_values": torch.randn(16, 12),
             "image_grid_thw": torch.tensor([[1, 4, 4]])}
    audio = {"input_features": torch.randn(1, 8, 30), "decoder_input_ids": torch.tensor([[1, 2]])}
    batches = calibration_batches([image, audio], max_seq_length=16)
    assert [sorted(b) for b in batches] == [sorted(image), sorted(audio)]
    assert batches[0]["input_ids"].shape == (1, 40)  # not cut: the image placeholders stay in step
    assert torch.equal(batches[1]["input_features"], audio["input_features"])
    with pytest.raises(DatasetError, match="input_features"):
        calibration_batches([{"labels": torch.tensor([[1]])}])


def test_texts_longer_than_the_tokenizers_limit_are_windowed_without_its_length_warning(capfd):
    tokenizer = make_word_tokenizer(32)
    tokenizer.model_max_length = 8  # the windows are cut by layerwise, never fed whole to the model
    text = " ".join(f"w{i % 30}" for i in range(40))
    batches = calibration_batches([text], tokenizer, num_samples=4, max_seq_length=8)
    assert [b["input_ids"].shape[1] for b in batches] == [8, 8, 8, 8]
    assert "Token indices sequence length" not in capfd.readouterr().err


def test_describe_data_names_the_source_and_hashes_it(tmp_path):
    import hashlib

    from layerwise.model_io.calibration_data import describe_data

    path = tmp_path / "calib.txt"
    path.write_text("one\n\ntwo\n")
    assert describe_data(str(path)) == {"description": "calib.txt (9 bytes)",
                                        "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert describe_data(["a", "b"]) == {"description": "2 texts given in memory",
                                         "sha256": hashlib.sha256(b"a\n\nb").hexdigest()}
    samples = describe_data([{"input_ids": torch.tensor([[1, 2, 3]])}])
    assert samples["description"] == "1 tokenized samples given in memory" and len(samples["sha256"]) == 64
    assert describe_data(None) == {}
