"""The `layerwise` command as a user runs it."""

import json

import pytest

from layerwise.cli import main


def test_compress_a_local_model_prints_a_summary(tiny_llama_dir, tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A16",
                 "--output-dir", str(out_dir), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "modules compressed: 14" in printed
    assert "saved to:" in printed and (out_dir / "config.json").is_file()


@pytest.mark.parametrize(("preset", "fmt"), [
    ("NVFP4A16", "nvfp4-pack-quantized"), ("NVFP4", "nvfp4-pack-quantized"), ("MXFP4A16", "mxfp4-pack-quantized"),
    ("MXFP4", "mxfp4-pack-quantized"), ("MXFP8A16", "mxfp8-quantized"), ("MXFP8", "mxfp8-quantized"),
    ("W4AFP8", "pack-quantized")])
def test_the_low_bit_float_presets_compress_from_the_command_line(preset, fmt, tmp_path, capsys):
    """What a user types: each 2026 preset by name, its checkpoint in the format vLLM reads for it."""
    from tests.conftest import build_tiny_llama, make_word_tokenizer

    tiny_llama_dir = tmp_path / "llama"  # inputs 128 wide: W4AFP8's groups of 128 divide them
    model = build_tiny_llama(hidden_size=128, intermediate_size=256)
    model.save_pretrained(tiny_llama_dir)
    make_word_tokenizer(model.config.vocab_size).save_pretrained(tiny_llama_dir)
    calib = tmp_path / "calib.txt"
    calib.write_text("\n".join(f"word{i} word{i + 1} word{i + 2} word{i + 3}" for i in range(8)))
    out_dir = tmp_path / "out"
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", preset, "--dataset", str(calib),
                 "--output-dir", str(out_dir), "--quiet"]) == 0
    assert "saved to:" in capsys.readouterr().out
    config = json.loads((out_dir / "config.json").read_text())["quantization_config"]
    assert config["format"] == fmt
    inputs = [group.get("input_activations") for group in config["config_groups"].values()]
    assert any(inputs) == (not preset.endswith("A16"))  # the A16 presets leave inputs alone


def test_bad_recipe_is_a_one_line_error_not_a_traceback(tiny_llama_dir, capsys):
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W5A16", "--quiet", "--no-save"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'W5A16'" in err and "W4A16" in err and "Traceback" not in err


def test_bad_model_path_names_it(tmp_path, capsys):
    assert main(["compress", "--model", str(tmp_path / "missing" / "model"), "--quiet", "--no-save"]) == 2
    assert "missing/model" in capsys.readouterr().err


def test_demo_w8a16_keeps_minilm_embeddings(minilm_path, tmp_path, capsys, monkeypatch):
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("LAYERWISE_CACHE", str(cache))
    assert main(["compress", "--recipe", "W8A16", "--quiet"]) == 0
    printed = capsys.readouterr().out
    cosine = float(printed.split("embedding cosine:")[1].split()[0])
    assert cosine > 0.98
    saved = cache / "demo" / "minilm-w8a16"
    assert (saved / "config.json").is_file()
    assert f"saved to:           {saved}  " in printed  # the full path, to find it again
    assert list(work.iterdir()) == []  # nothing left in the working directory (often a checkout)


def test_the_demo_cache_follows_layerwise_cache_then_xdg_then_home(monkeypatch, tmp_path):
    from layerwise.verbs.demo import cache_dir, demo_output_dir

    monkeypatch.delenv("LAYERWISE_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "layerwise"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo_output_dir("w4a16") == tmp_path / "xdg" / "layerwise" / "demo" / "minilm-w4a16"
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_the_demo_writes_to_an_explicit_output_dir(minilm_path, tmp_path, capsys):
    out = tmp_path / "here"
    assert main(["compress", "--recipe", "W8A16", "--output-dir", str(out), "--quiet"]) == 0
    assert (out / "config.json").is_file() and f"saved to:           {out}" in capsys.readouterr().out


def test_demo_default_is_gptq_calibrated_on_the_shipped_sentences(minilm_path, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path))
    assert main(["compress", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "GPTQ_W4A16" in printed and "GPTQModifier" in printed and "pipeline:           sequential" in printed
    samples = int(printed.split("calibration:")[1].split()[0])
    assert samples == 320
    cosine = float(printed.split("embedding cosine:")[1].split()[0])
    assert cosine > 0.975  # round-to-nearest W4A16 gives ~0.948 on the same sentences
    saved = tmp_path / "demo" / "minilm-gptq_w4a16"
    assert (saved / "config.json").is_file() and (saved / "gptq_summary.json").is_file()
    # the printed numbers are the report card's, recorded with the model (summary and card)
    quality = json.loads((saved / "layerwise_summary.json").read_text())["quality"]
    assert f"{quality['embeddings']['mean_cosine']:.4f}" == f"{cosine:.4f}" and quality["kind"] == "encoder"
    assert f"| embedding cosine to the original | 1 | {cosine:.4f} |" in (saved / "README.md").read_text()


def test_demo_folder_name_from_a_yaml_recipe_file(minilm_path, tmp_path, capsys, monkeypatch):
    from layerwise.cli.app import _slug

    assert _slug("GPTQ_W4A16") == "gptq_w4a16"
    assert _slug(str(tmp_path / "my recipe" / "gptq-int4.yaml")) == "gptq-int4"
    assert _slug("GPTQModifier:\n  scheme: W4A16\n") == "custom"


def test_a_closed_pipe_ends_the_command_quietly(monkeypatch, capsys):
    """``layerwise report out | head``: the reader stopping early is not an error."""
    from layerwise.cli import app as cli

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_run_compress", closed)
    assert cli.main(["compress", "--model", "x"]) == 0
    assert "error" not in capsys.readouterr().err


def test_bars_only_on_a_terminal_and_never_with_quiet(tiny_llama_dir, tmp_path, capfd, monkeypatch):
    """On a terminal the run draws bars (layerwise's and transformers'); with --quiet, or with stderr
    redirected to a log (where each redraw would be a line), none."""
    import sys

    from transformers.utils import logging as hf_logging

    data = tmp_path / "calib.txt"
    data.write_text("\n".join(" ".join(f"w{(7 * line + i) % 120}" for i in range(24)) for line in range(8)))
    argv = ["compress", "--model", str(tiny_llama_dir), "--recipe", "GPTQ_W8A16", "--dataset", str(data),
            "--num-samples", "4", "--max-seq-length", "16"]
    try:
        for terminal, quiet, drawn in ((True, False, True), (True, True, False), (False, False, False)):
            hf_logging.enable_progress_bar()  # each run starts as a fresh process would
            monkeypatch.setattr(sys.stderr, "isatty", lambda terminal=terminal: terminal)
            out = tmp_path / f"out-{terminal}-{quiet}"
            assert main([*argv, "--output-dir", str(out), *(["--quiet"] if quiet else [])]) == 0
            captured = capfd.readouterr()
            assert "saved to:" in captured.out
            assert ("it/s]" in captured.err) == drawn, (terminal, quiet, captured.err)
    finally:
        hf_logging.enable_progress_bar()


def test_compress_says_where_it_cut_and_where_the_time_went(tiny_llama_dir, tmp_path, capsys):
    data = tmp_path / "calib.txt"
    data.write_text("\n".join(f"the quick brown fox jumps over the lazy dog number {i}" for i in range(8)))
    for pieces in ("auto", "blocks"):
        assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "GPTQ_W8A16", "--dataset", str(data),
                     "--num-samples", "4", "--pieces", pieces, "--quiet", "--no-save"]) == 0
        printed = capsys.readouterr().out
        want = "pieces:             layers: " if pieces == "auto" else "pieces:             blocks: "
        assert want in printed
        time_line = next(line for line in printed.splitlines() if line.startswith("time:"))
        assert "forward " in time_line and "GPTQ Hessians " in time_line and "GFLOP/s" in time_line


def test_an_unknown_pieces_value_is_refused_by_the_parser(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["compress", "--pieces", "layer", "--no-save"])
    assert "invalid choice: 'layer'" in capsys.readouterr().err


def test_a_model_and_recipe_typed_without_flags_are_shown_with_them(capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "some/model", "GPTQ_W4A16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: some/model GPTQ_W4A16" in err
    assert "--model some/model --recipe GPTQ_W4A16" in err
    with pytest.raises(SystemExit):
        main(["compress", "--model", "m", "--bogus"])
    assert "(name them" not in capsys.readouterr().err  # a mistyped flag gets argparse's message alone


@pytest.mark.parametrize(("text", "size"), [("80GiB", 80 * 2**30), ("24G", 24 * 2**30), ("512MiB", 512 * 2**20),
                                            ("1.5", int(1.5 * 2**30)), ("80GB", 80 * 10**9)])
def test_memory_sizes_read_as_machines_write_them(text, size):
    from layerwise.cli.arguments import memory_size

    assert memory_size(text) == size


@pytest.mark.parametrize("text", ["0", "0GiB", "-5GiB", "eighty", "80 parsecs"])
def test_a_memory_size_of_nothing_or_nonsense_is_refused(text):
    import argparse

    from layerwise.cli.arguments import memory_size

    with pytest.raises(argparse.ArgumentTypeError, match="expected a size"):
        memory_size(text)


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_ctrl_c_during_compress_eval_says_the_output_was_written(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    """``compress --eval`` evaluates after saving: a Ctrl-C then leaves a complete output folder, and says so."""
    from layerwise.cli import evaluate

    heldout, out_dir = tmp_path / "heldout.txt", tmp_path / "out"
    heldout.write_text("w1 w2 w3 w4 w5\n")
    monkeypatch.setattr(evaluate, "evaluate_after_compress", _interrupt)
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--output-dir", str(out_dir),
                 "--eval", str(heldout), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert f"interrupted after the output folder '{out_dir}' was written (it is complete)" in err
    assert f"`layerwise eval {tiny_llama_dir} {out_dir} --dataset {heldout}` runs it again" in err
    assert "no output folder was written" not in err and (out_dir / "model.safetensors").is_file()


def test_ctrl_c_before_saving_says_nothing_was_written(tiny_llama_dir, tmp_path, capsys, monkeypatch):
    from layerwise.verbs import compression

    monkeypatch.setattr(compression, "load_model", _interrupt)
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--output-dir",
                 str(tmp_path / "out"), "--quiet"]) == 130
    assert "interrupted; no output folder was written" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
