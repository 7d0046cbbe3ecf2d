"""layerwise_summary.json: written by compress() with the model, read back whole; and `layerwise report`."""

from __future__ import annotations

import dataclasses
import json
import xml.etree.ElementTree as ET

import pytest
import torch

import layerwise
from layerwise.cli import main
from layerwise.reports.run_summary import (
    SUMMARY_FILE,
    SummaryError,
    read_summary,
    summary_from_document,
)
from tests.conftest import build_tiny_llama

RECIPE = "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n"


@pytest.fixture(scope="module")
def gptq_run(tmp_path_factory):
    """A real GPTQ run of a tiny Llama, saved; (model, output folder)."""
    out = tmp_path_factory.mktemp("summary") / "gptq"
    batches = [{"input_ids": torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i))}
               for i in range(3)]
    model = layerwise.compress(build_tiny_llama(hidden_size=128, intermediate_size=256), RECIPE, dataset=batches,
                               output_dir=out, show_progress=False)
    return model, out


def test_the_summary_round_trips_the_report(gptq_run):
    model, out = gptq_run
    saved = read_summary(out)
    report = model.layerwise_report
    assert saved.path == out / SUMMARY_FILE
    assert saved.report.layer_log == report.layer_log and len(saved.report.layer_log) == 14
    same = {f.name for f in dataclasses.fields(report)} - {"seconds", "accounting"}  # the file counts up to saving
    assert {name: getattr(saved.report, name) for name in same} == {name: getattr(report, name) for name in same}
    assert saved.report.accounting == {k: v for k, v in report.accounting.items() if k != "save"}
    assert 0 < saved.report.seconds <= report.seconds
    assert saved.report.pipeline == "sequential" and saved.report.fallbacks == []
    assert saved.report.guards_retraced == [] and saved.report.sequential_targets == ["LlamaDecoderLayer"]
    assert saved.report.recipe == (out / "recipe.yaml").read_text()
    assert saved.report.model == "LlamaForCausalLM"
    assert saved.layerwise_version == layerwise.__version__
    assert saved.environment["versions"]["torch"] and saved.environment["versions"]["transformers"]
    first = saved.report.layer_log[0]
    assert {"name", "loss", "seconds", "tokens"} <= set(first) and first["tokens"] == 48


def test_the_per_layer_log_lives_in_the_summary_only(gptq_run):
    _, out = gptq_run
    assert not (out / "layerwise_log.json").exists()
    assert json.loads((out / SUMMARY_FILE).read_text())["summary_format"] == 1


def test_a_failed_save_leaves_no_summary_behind(tmp_path, monkeypatch):
    """The summary is one of the saver's extra files: a write failing after it leaves no folder at all."""
    from layerwise.host.modifier import Modifier
    from layerwise.plugins.savers.compressed_tensors import SaveError

    written = []
    real_write_text = type(tmp_path).write_text
    monkeypatch.setattr(type(tmp_path), "write_text",
                        lambda self, *a, **k: (written.append(self.name), real_write_text(self, *a, **k))[1])
    monkeypatch.setattr(Modifier, "output_files", lambda self: {"../outside.json": "{}"})
    with pytest.raises(SaveError, match="outside the output folder"):
        layerwise.compress(build_tiny_llama(hidden_size=128, intermediate_size=256), "W4A16",
                           output_dir=tmp_path / "out", show_progress=False)
    assert SUMMARY_FILE in written  # it was written, then thrown away with the rest
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_compress_prints_the_chart(tiny_llama_dir, tmp_path, capsys):
    texts = [" ".join(f"w{(i * 7 + j) % 100}" for j in range(20)) for i in range(4)]
    data = tmp_path / "calib.txt"
    data.write_text("\n".join(texts))
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "GPTQ_W8A16", "--dataset", str(data),
                 "--num-samples", "4", "--max-seq-length", "16", "--output-dir", str(tmp_path / "o"),
                 "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "GPTQModifier loss per layer:" in printed and "worst:" in printed
    assert f"layerwise report {tmp_path / 'o'}" in printed
    assert "fallbacks:" not in printed  # said only when something fell back


def test_round_to_nearest_prints_no_chart(tiny_llama_dir, tmp_path, capsys):
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--output-dir",
                 str(tmp_path / "o"), "--quiet"]) == 0
    assert "loss per" not in capsys.readouterr().out
    assert main(["report", str(tmp_path / "o")]) == 0
    assert "no per-layer log" in capsys.readouterr().out


# -- layerwise report ----------------------------------------------------------------------
def test_report_shows_header_table_and_chart(gptq_run, capsys):
    _, out = gptq_run
    assert main(["report", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("pipeline:           sequential", "fallbacks:          none", "guards re-traced:   none",
                 "targets:            2 x LlamaDecoderLayer (model.layers.0-1), from the model patch", "model:              LlamaForCausalLM",
                 "modules compressed: 14", "calibration:        3 samples", "    - GPTQModifier:",
                 "pieces:             layers: 9 pieces cut before the layers modifiers read, one forward each"):
        assert line in printed
    time_line = next(line for line in printed.splitlines() if line.startswith("time:"))
    assert "GPTQ Hessians" in time_line and "GFLOP/s" in time_line and time_line.endswith("(up to saving)")
    table = [line for line in printed.splitlines() if line.startswith("model.layers.")]
    assert len(table) == 14 and table[0].split()[:2] == ["model.layers.0.self_attn.q_proj", "gptq"]
    assert "GPTQModifier loss per layer:" in printed


def test_report_top_ascii_and_json(gptq_run, capsys):
    model, out = gptq_run
    assert main(["report", str(out), "--top", "2", "--ascii"]) == 0
    printed = capsys.readouterr().out
    worst = max(model.layerwise_report.layer_log, key=lambda r: r["loss"])["name"]
    table = [line for line in printed.splitlines() if line.startswith("model.layers.")]
    assert len(table) == 2 and table[0].startswith(worst)
    assert "#" in printed and "█" not in printed
    assert main(["report", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == json.loads((out / SUMMARY_FILE).read_text())


def test_report_svg(gptq_run, tmp_path, capsys):
    model, out = gptq_run
    svg = tmp_path / "loss.svg"
    assert main(["report", str(out), "--svg", str(svg), "--scale", "linear"]) == 0
    assert f"SVG chart written to {svg}" in capsys.readouterr().out
    root = ET.parse(svg).getroot()
    rects = [r for r in root.iter("{http://www.w3.org/2000/svg}rect") if r.get("class") == "bar"]
    assert len(rects) == 14
    losses = [r["loss"] for r in model.layerwise_report.layer_log]
    heights = [float(r.get("height")) for r in rects]
    assert heights.index(max(heights)) == losses.index(max(losses))


def test_report_shows_fallbacks_and_retraced_guards(gptq_run, tmp_path, capsys):
    _, out = gptq_run
    document = json.loads((out / SUMMARY_FILE).read_text())
    document["fallbacks"] = ["pipeline 'sequential' cannot calibrate X, falling back to 'layer_sequential'. Why: t"]
    document["guards_retraced"] = ["model.layers.0: attention_mask was None"]
    folder = tmp_path / "edited"
    folder.mkdir()
    (folder / SUMMARY_FILE).write_text(json.dumps(document))
    assert main(["report", str(folder)]) == 0
    printed = capsys.readouterr().out
    assert "fallbacks:          pipeline 'sequential' cannot calibrate X" in printed
    assert "guards re-traced:   model.layers.0: attention_mask was None" in printed


# -- errors --------------------------------------------------------------------------------
def _error(capsys, *argv) -> str:
    assert main(["report", *argv]) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    return captured.err


def test_missing_folder(tmp_path, capsys):
    err = _error(capsys, str(tmp_path / "nope"))
    assert "nope' does not exist" in err and "--output-dir" in err


def test_a_folder_without_a_summary_says_why_and_the_fix(tmp_path, capsys):
    assert "not a layerwise output folder" in _error(capsys, str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    err = _error(capsys, str(tmp_path))
    assert f"no {SUMMARY_FILE}" in err and "older than the run summary" in err and "Compress the model again" in err


def test_corrupt_summary(tmp_path, capsys):
    (tmp_path / SUMMARY_FILE).write_text('{"summary_format": 1, "pipeline": ')
    err = _error(capsys, str(tmp_path))
    assert "is not valid JSON" in err and SUMMARY_FILE in err


def test_summaries_that_are_not_ours_or_cut_short():
    with pytest.raises(SummaryError, match="not a layerwise run summary"):
        summary_from_document([1, 2])
    with pytest.raises(SummaryError, match="newer than this layerwise reads"):
        summary_from_document({"summary_format": 99})
    with pytest.raises(SummaryError, match="lacks pipeline, modifiers"):
        summary_from_document({"summary_format": 1})


def test_an_unwritable_svg_path(gptq_run, tmp_path, capsys):
    _, out = gptq_run
    err = _error(capsys, str(out), "--svg", str(tmp_path / "no" / "such" / "dir" / "x.svg"))
    assert "cannot write the SVG chart" in err and "x.svg" in err
