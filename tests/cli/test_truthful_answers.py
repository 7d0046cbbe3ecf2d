"""What layerwise says is true: named errors before any work, warnings for legal mistakes, honest reports."""

import pytest

import layerwise
from layerwise.cli import main
from tests.conftest import build_tiny_llama


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["compress", "--quiet", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_an_already_quantized_folder_is_named_with_its_scheme_before_loading(tiny_llama_dir, tmp_path, capsys,
                                                                             monkeypatch):
    from layerwise.verbs import compression

    assert run(capsys, "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--output-dir", str(tmp_path / "q"))[0] == 0
    monkeypatch.setattr(compression, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    code, _, err = run(capsys, "--model", str(tmp_path / "q"), "--recipe", "GPTQ_W4A16", "--dataset", "x.txt",
                       "--output-dir", str(tmp_path / "again"))
    assert code == 2 and "is already quantized (compressed-tensors pack-quantized: int8 weights, per channel)" in err
    assert "compress the original, unquantized model" in err and "no quantized module" not in err


def test_a_mistyped_folder_is_named_at_once_with_the_nearest_one(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    import shutil

    shutil.copytree(tiny_llama_dir, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run(capsys, "--model", "modle", "--output-dir", "out")
    assert code == 2 and "no folder 'modle' here; did you mean 'model'?" in err and "HF_HUB_OFFLINE" in err
    code, _, err = run(capsys, "--model", "mod le", "--output-dir", "out")  # no hub id has a space
    assert code == 2 and "model folder 'mod le' does not exist" in err


def test_calibration_beyond_the_context_and_too_few_samples_are_warned(tiny_llama_dir, tmp_path, capsys):
    from layerwise.model_io.calibration_data import CalibrationWarning

    (tmp_path / "calib.txt").write_text("the cat sat on the mat\n")
    with pytest.warns(CalibrationWarning) as warned:
        code, _, _ = run(capsys, "--model", str(tiny_llama_dir), "--recipe", "GPTQ_W8A16", "--dataset",
                         str(tmp_path / "calib.txt"), "--max-seq-length", "4096", "--output-dir", str(tmp_path / "out"))
    messages = " | ".join(str(w.message) for w in warned)
    assert code == 0
    assert "max_seq_length=4096 is beyond the model's context of 128 tokens" in messages
    assert "1 calibration sample: GPTQModifier needs at least 16" in messages


def test_a_dataset_a_data_free_recipe_will_not_read_is_warned_and_a_missing_one_is_an_error(tiny_llama_dir, tmp_path,
                                                                                            capsys):
    from layerwise.model_io.calibration_data import CalibrationWarning

    (tmp_path / "calib.txt").write_text("words\n")
    with pytest.warns(CalibrationWarning, match="reads no calibration data, so the dataset given is not used"):
        code, _, err = run(capsys, "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--dataset",
                           str(tmp_path / "calib.txt"), "--output-dir", str(tmp_path / "out"))
    assert code == 0
    code, _, err = run(capsys, "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--dataset",
                       str(tmp_path / "missing.txt"), "--output-dir", str(tmp_path / "out2"))
    assert code == 2 and "calibration file" in err and "missing.txt' does not exist" in err
    assert not (tmp_path / "out2").exists()


def test_awq_records_name_their_layers_for_the_report(tmp_path):
    from layerwise.reports.text import layer_table

    batches = [{"input_ids": layerwise_ids(i)} for i in range(4)]
    model = layerwise.compress(build_tiny_llama(hidden_size=128, intermediate_size=256), "AWQ_W4A16_ASYM",
                               dataset=batches, show_progress=False)
    records = [r for r in model.layerwise_report.layer_log if r.get("modifier") == "AWQModifier"]
    assert records and all(r.get("name") for r in records)
    assert not any(line.split()[0] == "?" for line in layer_table(records)[1:])


def layerwise_ids(seed: int):
    import torch

    return torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(seed))


def test_printing_the_report_gives_the_summary_not_a_field_dump():
    model = layerwise.compress(build_tiny_llama(), "W8A16", show_progress=False)
    text = str(model.layerwise_report)
    assert text.startswith("pipeline:           datafree") and "modules compressed: 14" in text
    assert "CompressionReport(" not in text and len(text) < 1500
