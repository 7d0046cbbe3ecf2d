"""``layerwise trace`` on local folders, as a new user would run it."""

from __future__ import annotations

import argparse
import io

import models
from layerwise.tracing import cli


def _run(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="layerwise")
    cli.add_parser(parser.add_subparsers(dest="command"))
    out = io.StringIO()
    code = cli.run(parser.parse_args(argv), out=out)
    return code, out.getvalue()


def test_config_only_folder_verify_and_dot(tmp_path) -> None:
    models.build("LlamaForCausalLM").config.save_pretrained(tmp_path)
    code, text = _run(["trace", "--model", str(tmp_path), "--verify", "--graph", str(tmp_path / "g.dot")])
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


def test_bad_targets_report_failure(tmp_path) -> None:
    models.build("GPT2LMHeadModel").config.save_pretrained(tmp_path)
    code, text = _run(["trace", "--model", str(tmp_path), "--targets", "NoSuchLayer"])
    assert code == 1 and "match no module" in text
