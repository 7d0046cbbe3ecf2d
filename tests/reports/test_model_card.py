"""The model card: valid Hub metadata, the metrics, pictures beside it, and a user's README never overwritten."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch
import yaml

import layerwise
from layerwise.reports.model_card import (
    CARD_FILE,
    CARD_MARK,
    KL_PICTURE,
    LOSS_PICTURE,
    card_files,
    is_layerwise_card,
    recipe_tags,
    write_card,
)
from layerwise.reports.quality import evaluate
from layerwise.reports.run_report import CompressionReport
from layerwise.reports.run_summary import SUMMARY_FILE, read_summary, record_quality
from tests.conftest import build_tiny_llama, make_word_tokenizer
from tests.reports.test_quality import word_texts

RECIPE = "GPTQModifier:\n  scheme: W4A16\n  group_size: 32\n  ignore: [lm_head]\n"


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """A saved GPTQ run of a tiny Llama and its report card (not yet recorded)."""
    out = tmp_path_factory.mktemp("card") / "llama-gptq"
    batches = [{"input_ids": torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i))}
               for i in range(3)]
    model = layerwise.compress(build_tiny_llama(), RECIPE, dataset=batches, output_dir=out, show_progress=False)
    quality = evaluate(build_tiny_llama(), model, word_texts(), make_word_tokenizer(128), window_length=32,
                       max_windows=6, show_progress=False)
    return out, quality


def front_matter(text: str) -> dict:
    assert text.startswith("---\n")
    head, _, _ = text[4:].partition("\n---\n")
    return yaml.safe_load(head)


def test_the_card_is_valid_model_card_yaml_with_the_metrics(evaluated):
    out, quality = evaluated
    card = card_files(read_summary(out), quality)[CARD_FILE]
    front = front_matter(card)
    assert front["library_name"] == "transformers"
    assert front["tags"][:2] == ["compressed-tensors", "layerwise"] and {"gptq", "w4a16"} <= set(front["tags"])
    assert front["pipeline_tag"] == "text-generation" and "base_model" not in front  # a module, not a hub id
    metrics = front["model-index"][0]["results"][0]["metrics"]
    assert metrics[0] == {"type": "perplexity", "value": round(quality.tokens.perplexity_compressed, 4),
                          "name": "perplexity"}
    assert CARD_MARK in card and f"| perplexity | {quality.tokens.perplexity_original:.4f} |" in card
    assert quality.data["sha256"] in card and "```yaml\nlayerwise_stage:" in card
    assert f"![KL divergence per window and per position]({KL_PICTURE})" in card and LOSS_PICTURE in card


def test_a_hub_model_is_named_the_base_model():
    report = CompressionReport(pipeline="datafree", modifiers=["QuantizationModifier"], compressed_modules=[],
                               seconds=1.0, bytes_before=10, bytes_after=5, calibration_samples=0,
                               model="meta-llama/Llama-3.2-1B", recipe="QuantizationModifier:\n  scheme: W8A16\n")
    front = front_matter(card_files(report)[CARD_FILE])
    assert front["base_model"] == "meta-llama/Llama-3.2-1B" and front["base_model_relation"] == "quantized"
    assert "model-index" not in front and "pipeline_tag" not in front
    assert "w8a16" in front["tags"]


MXFP4_MAPPING = "{weights: {num_bits: 4, type: float, strategy: group, group_size: 32, scale_dtype: e8m0}}"


@pytest.mark.parametrize("scheme, bfloat16", [("NVFP4A16", True), ("MXFP8A16", True), ("W4A16", False),
                                              (MXFP4_MAPPING, True)])
def test_the_card_loads_fp4_and_mx_checkpoints_in_bfloat16(scheme, bfloat16):
    # compressed-tensors 0.20 runs these formats in bfloat16 only: a float32 from_pretrained fails its forward
    report = CompressionReport(pipeline="datafree", modifiers=["QuantizationModifier"], compressed_modules=[],
                               seconds=1.0, bytes_before=10, bytes_after=5, calibration_samples=0, model="m",
                               recipe=f"QuantizationModifier:\n  scheme: {scheme}\n")
    card = card_files(report, name="out")[CARD_FILE]
    assert ('from_pretrained("out", dtype=torch.bfloat16)' in card) is bfloat16
    assert 'layerwise.load_compressed("out")' in card


@pytest.mark.parametrize(("key", "kv_cache"), [("kv_cache_scheme", "fp8"), ("kv_cache_scheme", None),
                                              ("attention_scheme", "fp8")])
def test_the_card_says_how_vllm_serves_it_with_the_kv_cache_flag_where_there_is_one(key, kv_cache):
    report = CompressionReport(pipeline="sequential", modifiers=["QuantizationModifier"], compressed_modules=[],
                               seconds=1.0, bytes_before=10, bytes_after=5, calibration_samples=4, model="m",
                               recipe=f"QuantizationModifier:\n  scheme: W4A16\n  {key}: {kv_cache or 'null'}\n")
    card = card_files(report, name="out")[CARD_FILE]
    command = "vllm serve out --kv-cache-dtype fp8" if kv_cache else "vllm serve out\n"
    assert "## How to serve" in card and command in card
    assert ("k_scale" in card) is bool(kv_cache)


@pytest.mark.parametrize(("architecture", "auto"), [("LlamaForCausalLM", "AutoModelForCausalLM"),
                                                    ("BertModel", "AutoModel")])
def test_the_card_loads_a_causal_lm_with_its_head_before_any_eval(architecture, auto):
    report = CompressionReport(pipeline="datafree", modifiers=["QuantizationModifier"], compressed_modules=[],
                               seconds=1.0, bytes_before=10, bytes_after=5, calibration_samples=0, model="m",
                               recipe="QuantizationModifier:\n  scheme: W8A16\n", architecture=architecture)
    assert f'model = {auto}.from_pretrained("out")' in card_files(report, name="out")[CARD_FILE]


def test_a_saved_run_records_its_architecture(tmp_path):
    layerwise.compress(build_tiny_llama(), "W8A16", output_dir=tmp_path / "out", show_progress=False)
    assert read_summary(tmp_path / "out").report.architecture == "LlamaForCausalLM"
    assert "AutoModelForCausalLM.from_pretrained" in (tmp_path / "out" / CARD_FILE).read_text()


def test_recipe_tags_name_algorithms_schemes_and_bits():
    report = CompressionReport(pipeline="p", modifiers=["SparseGPTModifier", "QuantizationModifier"],
                               compressed_modules=[], seconds=0, bytes_before=1, bytes_after=1, calibration_samples=1,
                               recipe="s:\n  SparseGPTModifier: {sparsity: 0.5}\n  QuantizationModifier:\n"
                                      "    scheme: W4A16\n    num_bits: 3\n")
    assert recipe_tags(report) == ["compressed-tensors", "layerwise", "sparsegpt", "sparse", "w4a16", "3-bit"]


def test_write_card_records_pictures_and_rewrites_its_own_card(evaluated, tmp_path):
    out, quality = evaluated
    record_quality(out, quality.to_dict())
    (out / CARD_FILE).unlink(missing_ok=True)
    assert json.loads((out / SUMMARY_FILE).read_text())["quality"]["tokens"]["kl_max"] == quality.tokens.kl_max
    card = write_card(out)
    assert card == out / CARD_FILE and is_layerwise_card(card)
    for picture in (KL_PICTURE, LOSS_PICTURE):
        ET.fromstring((out / picture).read_text())  # well-formed SVG
    assert (out / KL_PICTURE).read_text().count("<rect") == 6  # one bar per window
    assert write_card(out) == card  # its own card is rewritten


def test_a_user_readme_is_kept(evaluated):
    out, quality = evaluated
    (out / CARD_FILE).write_text("# my model\n\nMy own words.\n")
    assert write_card(out, quality=quality) is None
    assert (out / CARD_FILE).read_text() == "# my model\n\nMy own words.\n"
    assert (out / KL_PICTURE).is_file()  # the pictures are written all the same


def test_a_second_compress_keeps_the_user_readme(tmp_path):
    out = tmp_path / "out"
    layerwise.compress(build_tiny_llama(), "W8A16", output_dir=out, show_progress=False)
    (out / CARD_FILE).write_text("# mine\n")
    layerwise.compress(build_tiny_llama(seed=1), "W8A16", output_dir=out, overwrite=True, show_progress=False)
    assert (out / CARD_FILE).read_text() == "# mine\n" and (out / SUMMARY_FILE).is_file()
    # layerwise's own card is not carried: the new run's files replace it
    (out / CARD_FILE).unlink()
    assert write_card(out) == out / CARD_FILE
    layerwise.compress(build_tiny_llama(), "W8A16", output_dir=out, overwrite=True, show_progress=False)
    assert is_layerwise_card(out / CARD_FILE)  # the new run writes its own card


def test_a_summary_without_quality_still_reads(evaluated, tmp_path):
    out, _ = evaluated
    document = json.loads((out / SUMMARY_FILE).read_text())
    old = {k: v for k, v in document.items() if k not in ("quality", "calibration_data")}
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / SUMMARY_FILE).write_text(json.dumps(old))
    summary = read_summary(folder)
    assert summary.report.quality is None and summary.report.calibration_data == {}
    assert front_matter(card_files(summary)[CARD_FILE])["library_name"] == "transformers"


def test_pngs_are_drawn_where_a_renderer_is_installed(evaluated, monkeypatch):
    import sys
    import types

    out, quality = evaluated
    drawn = []
    renderer = types.ModuleType("cairosvg")
    renderer.svg2png = lambda url, write_to, background_color: drawn.append((url, write_to))
    monkeypatch.setitem(sys.modules, "cairosvg", renderer)
    (out / CARD_FILE).unlink(missing_ok=True)
    write_card(out, quality=quality)
    assert sorted(target.rsplit("/", 1)[1] for _, target in drawn) == ["layerwise_kl.png", "layerwise_layer_loss.png"]
