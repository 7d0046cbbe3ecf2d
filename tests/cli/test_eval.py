"""``layerwise eval``, ``compress --eval``'s step, and ``layerwise report`` showing the card.
"""

from __future__ import annotations

import argparse
import json
import shutil

import pytest

import layerwise
from layerwise.cli import evaluate as evaluate_cli
from layerwise.errors import DatasetError
from layerwise.reports.model_card import CARD_FILE, KL_PICTURE
from layerwise.reports.quality import QualityReport
from layerwise.reports.run_summary import SUMMARY_FILE, read_summary
from tests.conftest import build_tiny_llama, make_word_tokenizer
from tests.reports.test_quality import word_texts

W4 = "QuantizationModifier:\n  scheme: W4A16\n  group_size: 32\n  ignore: [lm_head]\n"


@pytest.fixture
def cli():
    from layerwise.cli import main

    return main


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(original folder, compressed output folder, eval.txt), the output compressed W4A16 from the original."""
    root = tmp_path_factory.mktemp("eval")
    original = root / "tiny-llama"
    build_tiny_llama().save_pretrained(original)
    make_word_tokenizer(128).save_pretrained(original)
    layerwise.compress(str(original), W4, output_dir=root / "out", show_progress=False)
    text = root / "eval.txt"
    text.write_text("\n\n".join(word_texts()))
    return original, root / "out", text


@pytest.fixture
def out(folders, tmp_path):
    """A fresh copy of the compressed output (tests write their cards into it)."""
    copy = tmp_path / "out"
    shutil.copytree(folders[1], copy)
    return copy


def test_eval_prints_the_card_and_saves_it_with_the_output(cli, folders, out, capsys):
    original, _, text = folders
    assert cli(["eval", str(original), str(out), "--dataset", str(text), "--window-length", "32",
                "--max-windows", "8", "--quiet", "--ascii"]) == 0
    printed = capsys.readouterr().out
    assert "perplexity:" in printed and "KL divergence:" in printed and "top-5 agreement:" in printed
    assert "KL divergence per window (mean over its tokens), 8 windows:" in printed and "#" in printed
    assert f"recorded in:        {out / SUMMARY_FILE}" in printed
    quality = read_summary(out).report.quality
    assert quality["data"]["windows"] == 8 and quality["data"]["sha256"] in (out / CARD_FILE).read_text()
    assert (out / KL_PICTURE).is_file()

    assert cli(["report", str(out), "--ascii"]) == 0
    shown = capsys.readouterr().out
    assert "report card (layerwise eval):" in shown and f"{quality['tokens']['top1_agreement']:.4f}" in shown


def test_no_record_leaves_the_folder_and_json_prints_the_card(cli, folders, out, capsys, tmp_path):
    original, _, text = folders
    before = sorted(p.name for p in out.iterdir())
    svg = tmp_path / "kl.svg"
    assert cli(["eval", str(original), str(out), "--dataset", str(text), "--window-length", "32", "--max-windows",
                "3", "--no-record", "--json", "--svg", str(svg), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tokens"]["tokens"] == 3 * 31
    assert f"written to {svg}" in captured.err and svg.read_text().startswith("<svg")
    assert sorted(p.name for p in out.iterdir()) == before


def test_a_user_readme_is_kept_and_said_so(cli, folders, out, capsys):
    original, _, text = folders
    (out / CARD_FILE).write_text("# ours\n")
    assert cli(["eval", str(original), str(out), "--dataset", str(text), "--window-length", "32", "--max-windows",
                "2", "--quiet"]) == 0
    assert "is yours (it lacks layerwise's mark) and was kept" in capsys.readouterr().out
    assert (out / CARD_FILE).read_text() == "# ours\n" and read_summary(out).report.quality


def test_a_folder_layerwise_did_not_write_is_compared_not_recorded(cli, folders, capsys):
    original, _, text = folders
    assert cli(["eval", str(original), str(original), "--dataset", str(text), "--window-length", "32",
                "--max-windows", "2", "--placement", "one-at-a-time", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "KL divergence:      mean 0.000e+00" in printed and "top-1 agreement:    1.0000" in printed
    assert "not recorded" in printed and not (original / CARD_FILE).exists()


def test_tasks_without_lm_eval_fail_before_loading(cli, folders, monkeypatch, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "lm_eval", None)
    original, compressed, text = folders
    assert cli(["eval", str(original), str(compressed), "--dataset", str(text), "--tasks", "arc_easy"]) == 2
    assert "pip install -c constraints.txt 'layerwise[eval]'" in capsys.readouterr().err


def test_bad_input_is_one_error_line(cli, folders, tmp_path, capsys):
    original, compressed, _ = folders
    assert cli(["eval", str(original), str(compressed), "--dataset", str(tmp_path / "none.txt")]) == 2
    assert "evaluation file" in capsys.readouterr().err
    (tmp_path / "short.txt").write_text("w1 w2\n")
    assert cli(["eval", str(original), str(compressed), "--dataset", str(tmp_path / "short.txt"),
                "--window-length", "32", "--quiet"]) == 2
    assert "fewer than one window of 32" in capsys.readouterr().err
    assert cli(["eval", str(original), str(tmp_path), "--dataset", str(tmp_path / "short.txt")]) == 2
    assert "no config.json" in capsys.readouterr().err
    # the two folders swapped: a quantized ORIGINAL measures nothing
    assert cli(["eval", str(compressed), str(original), "--dataset", str(folders[2]), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"the original '{compressed}' is already quantized" in err and "as ORIGINAL" in err
    # windows longer than the model's context (the tiny Llama's max_position_embeddings)
    context = build_tiny_llama().config.max_position_embeddings
    assert cli(["eval", str(original), str(compressed), "--dataset", str(folders[2]), "--window-length",
                str(context * 2), "--quiet", "--no-record"]) == 2
    assert f"longer than the model's context ({context} tokens)" in capsys.readouterr().err


def compress_args(**given) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    evaluate_cli.add_compress_options(parser)
    args = parser.parse_args([])
    defaults = dict(model=None, device=None, quiet=True, trust_remote_code=False)
    return argparse.Namespace(**{**vars(args), **defaults, **given})


def test_compress_eval_evaluates_the_saved_output(folders, tmp_path, capsys):
    original, _, text = folders
    args = compress_args(model=str(original), eval=str(text), eval_window_length=32, eval_max_windows=4)
    evaluate_cli.check_compress_eval(args)
    model = layerwise.compress(str(original), W4, output_dir=tmp_path / "out", show_progress=False)
    quality = evaluate_cli.evaluate_after_compress(args, model)
    assert quality.compressed == str(tmp_path / "out") and quality.data["windows"] == 4
    assert QualityReport.from_dict(read_summary(tmp_path / "out").report.quality) == quality
    assert (tmp_path / "out" / CARD_FILE).is_file() and "perplexity:" in capsys.readouterr().out


def test_compress_eval_without_saving_compares_the_model_in_memory(folders):
    original, _, text = folders
    model = layerwise.compress(str(original), W4, show_progress=False)
    args = compress_args(model=str(original), eval=str(text), eval_window_length=32, eval_max_windows=2)
    quality = evaluate_cli.evaluate_after_compress(args, model)
    assert quality.compressed == "LlamaForCausalLM" and quality.tokens.kl_mean > 0
    assert evaluate_cli.evaluate_after_compress(compress_args(eval=None), model) is None
    with pytest.raises(DatasetError, match="does not exist"):
        evaluate_cli.check_compress_eval(compress_args(eval="missing.txt"))


def test_a_comparison_with_another_model_than_the_folder_s_original_is_not_recorded(cli, folders, out, tmp_path,
                                                                                     capsys):
    other = tmp_path / "other-llama"
    shutil.copytree(folders[0], other)  # the same weights, another folder: not the one the summary names
    before = (out / SUMMARY_FILE).read_text()
    assert cli(["eval", str(other), str(out), "--dataset", str(folders[2]), "--quiet", "--max-windows", "2"]) == 0
    printed = capsys.readouterr().out
    assert f"not recorded: '{out}' was compressed from '{folders[0]}'" in printed
    assert (out / SUMMARY_FILE).read_text() == before
