"""``layerwise trace`` on local folders, as a new user would run it."""

from __future__ import annotations

import argparse
import io

import models

from layerwise.cli import trace as cli
from tests.conftest import skip_unless_verified


def _run(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="layerwise")
    cli.add_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    code = cli.run(parser.parse_args(argv), out=out)
    return code, out.getvalue()


def test_config_only_folder_verify_and_dot(tmp_path) -> None:
    models.build("LlamaForCausalLM").config.save_pretrained(tmp_path / "model")
    code, text = _run(["trace", "--model", str(tmp_path / "model"), "--verify", "--graph", str(tmp_path / "g.dot")])
    assert code == 0, text
    assert "Traced LlamaForCausalLM into 3 subgraphs" in text
    assert "model.layers.1" in text and "max abs diff: 0.000e+00" in text
    assert (tmp_path / "g.dot").read_text().startswith("digraph")


def test_saved_weights_encoder_decoder_and_targets(tmp_path) -> None:
    models.build("T5ForConditionalGeneration").save_pretrained(tmp_path)
    code, text = _run(["trace", "--model", str(tmp_path), "--targets", "re:.*decoder\\.block\\.\\d+", "--verify"])
    assert code == 0, text
    assert "Traced T5ForConditionalGeneration into 3 subgraphs" in text
    assert "decoder.block.0" in text and "max abs diff:" in text


def test_meta_build_without_verify_and_audio(tmp_path) -> None:
    models.build("WhisperForConditionalGeneration").config.save_pretrained(tmp_path)
    code, text = _run(["trace", "--model", str(tmp_path), "--modality", "audio"])
    assert code == 0, text
    assert "into 5 subgraphs" in text and "max abs diff" not in text


def test_bad_targets_are_a_usage_error_with_the_closest_names(tmp_path, capsys) -> None:
    from layerwise.cli import main

    models.build("GPT2LMHeadModel").config.save_pretrained(tmp_path)
    for flag, typo in (("--targets", "GPT2Blok"), ("--ignore", "lm_haed")):
        assert main(["trace", "--model", str(tmp_path), flag, typo]) == 2
        err = capsys.readouterr().err
        assert f"{typo!r} matches no module of GPT2LMHeadModel" in err and "did you mean" in err
        assert "Traceback" not in err


def _tiny_qwen2_vl_config():
    import transformers as tf

    return tf.Qwen2VLConfig(
        text_config=dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253,
        architectures=["Qwen2VLForConditionalGeneration"])


def test_vision_language_model_uses_its_patch_and_an_svg_falls_back_to_dot(tmp_path, monkeypatch) -> None:
    from layerwise.model_zoo.qwen2_vl import QWEN2_VL

    skip_unless_verified(QWEN2_VL)
    _tiny_qwen2_vl_config().save_pretrained(tmp_path / "model")  # the graph goes beside, never into the model
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)  # as on a machine without graphviz
    code, text = _run(["trace", "--model", str(tmp_path / "model"), "--modality", "image", "--verify",
                       "--graph", str(tmp_path / "g.svg")])
    assert code == 0, text
    assert "patch: qwen2_vl" in text and "Inputs (image): input_ids" in text
    assert "into 5 subgraphs (4 targets" in text
    rows = [line.split()[1] for line in text.splitlines() if line[:1].isdigit()]
    assert rows == ["model.visual.blocks.0", "model.visual.blocks.1", "model.language_model.layers.0",
                    "model.language_model.layers.1", "(rest)"]
    assert f"graphviz 'dot' not found (apt install graphviz), so {tmp_path / 'g.svg'} was not drawn; the graph's " \
           f"DOT text was written to {tmp_path / 'g.dot'} instead" in text
    assert (tmp_path / "g.dot").read_text().startswith("digraph")
    assert "/site-packages/" not in text  # wrapped statements name files from the package root
    assert "max abs diff: 0.000e+00" in text and "ok, tolerance" in text


def test_text_inputs_leave_vision_targets_out_with_a_note(tmp_path) -> None:
    _tiny_qwen2_vl_config().save_pretrained(tmp_path)
    code, text = _run(["trace", "--model", str(tmp_path), "--modality", "text"])
    assert code == 0, text
    assert "into 3 subgraphs" in text
    assert "not run by these inputs, left out: model.visual.blocks.0, model.visual.blocks.1" in text
    assert "Never called (with what they hold): model.visual\n" in text
    code, text = _run(["trace", "--model", str(tmp_path), "--modality", "audio"])
    assert code == 1 and "Cannot build audio inputs" in text


def test_a_model_nothing_describes_is_traced_by_its_blocks_and_a_patch_is_suggested(tmp_path) -> None:
    import transformers as tf

    tf.MPNetConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=96,
                   max_position_embeddings=64, architectures=["MPNetModel"]).save_pretrained(tmp_path)
    code, text = _run(["trace", "--model", str(tmp_path), "--verify", "--suggest-patch"])
    assert code == 0, text
    assert "Targets (found by structure): 2 x MPNetLayer (encoder.layer.0-1); no patch names these blocks" in text
    assert "into 3 subgraphs" in text and "ok, tolerance" in text
    suggested = text.split("Suggested patch (a plugin module's start; `layerwise new-patch` scaffolds the package "
                           "and its test):\n")[1].split("max abs diff")[0]
    assert 'sequential_targets=("MPNetLayer",)' in suggested and 'ignore=("pooler.dense",)' in suggested
    assert "layerwise.host" not in suggested  # a plugin imports the public API only (GUIDE section 12)
    namespace: dict = {}
    exec(compile(suggested, "suggested.py", "exec"), namespace)  # noqa: S102 - our own output: it builds its patch
    assert namespace["MPNET"].verified_transformers == (tf.__version__, tf.__version__)
