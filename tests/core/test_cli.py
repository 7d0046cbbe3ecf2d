"""The `layerwise` command as a user runs it."""


from layerwise.cli import main


def test_compress_a_local_model_prints_a_summary(tiny_llama_dir, tmp_path, capsys):
    out_dir = tmp_path / "out"
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A16",
                 "--output-dir", str(out_dir), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "modules compressed: 14" in printed
    assert "saved to:" in printed and (out_dir / "config.json").is_file()


def test_bad_recipe_is_a_one_line_error_not_a_traceback(tiny_llama_dir, capsys):
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W5A16", "--quiet", "--no-save"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe 'W5A16'" in err and "W4A16" in err and "Traceback" not in err


def test_bad_model_path_names_it(tmp_path, capsys):
    assert main(["compress", "--model", str(tmp_path / "missing" / "model"), "--quiet", "--no-save"]) == 2
    assert "missing/model" in capsys.readouterr().err


def test_demo_w8a16_keeps_minilm_embeddings(minilm_path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["compress", "--recipe", "W8A16", "--quiet"]) == 0
    printed = capsys.readouterr().out
    cosine = float(printed.split("sentence-embedding cosine to fp32:")[1].split()[0])
    assert cosine > 0.98
    assert (tmp_path / "layerwise-minilm-w8a16" / "config.json").is_file()


def test_demo_default_is_gptq_calibrated_on_the_shipped_sentences(minilm_path, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["compress", "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "GPTQ_W4A16" in printed and "GPTQModifier" in printed and "pipeline:           sequential" in printed
    samples = int(printed.split("calibration:")[1].split()[0])
    assert samples == 320
    cosine = float(printed.split("sentence-embedding cosine to fp32:")[1].split()[0])
    assert cosine > 0.975  # round-to-nearest W4A16 gives ~0.948 on the same sentences
    assert (tmp_path / "layerwise-minilm-gptq_w4a16" / "config.json").is_file()
    assert (tmp_path / "layerwise-minilm-gptq_w4a16" / "gptq_summary.json").is_file()


def test_demo_folder_name_from_a_yaml_recipe_file(minilm_path, tmp_path, capsys, monkeypatch):
    from layerwise.cli import _slug

    assert _slug("GPTQ_W4A16") == "gptq_w4a16"
    assert _slug(str(tmp_path / "my recipe" / "gptq-int4.yaml")) == "gptq-int4"
    assert _slug("GPTQModifier:\n  scheme: W4A16\n") == "custom"


def test_a_closed_pipe_ends_the_command_quietly(monkeypatch, capsys):
    """``layerwise report out | head``: the reader stopping early is not an error."""
    from layerwise import cli

    def closed(args):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "_run_compress", closed)
    assert cli.main(["compress", "--model", "x"]) == 0
    assert "error" not in capsys.readouterr().err
