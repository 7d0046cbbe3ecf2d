"""``report --svg``, ``eval --svg`` and ``trace --graph`` never write over a file (a model's weights or config,
the run summary, the dataset) nor into a model folder, and say so before any slow work."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

import layerwise
from layerwise.cli import main
from layerwise.cli import trace as trace_cli
from layerwise.verbs import evaluation


@pytest.fixture(scope="module")
def output(tmp_path_factory) -> Path:
    from tests.conftest import build_tiny_llama, make_word_tokenizer

    root = tmp_path_factory.mktemp("run")
    model = build_tiny_llama()
    model.save_pretrained(root / "model")
    make_word_tokenizer(model.config.vocab_size).save_pretrained(root / "model")
    layerwise.compress(root / "model", "W8A16", output_dir=root / "out", show_progress=False)
    return root / "out"


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _never(*args, **kwargs):
    raise AssertionError("the slow work ran before the output file was checked")


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "layerwise_summary.json"])
def test_report_svg_never_replaces_a_file_of_the_folder(name, output, tmp_path, capsys):
    folder = Path(shutil.copytree(output, tmp_path / "rep"))
    before = _digests(folder)
    assert main(["report", str(folder), "--svg", str(folder / name)]) == 2
    captured = capsys.readouterr()
    assert f"{name}' exists: choose another name for the SVG chart or delete it first" in captured.err
    assert captured.out == "" and _digests(folder) == before
    assert main(["report", str(folder), "--svg", str(folder / "loss.svg")]) == 0  # a new file there is fine
    assert (folder / "loss.svg").read_text().startswith("<svg")


@pytest.mark.parametrize("where", ["config.json", "model.safetensors", "graph.dot"])
def test_trace_graph_never_writes_into_the_model_folder(where, output, tmp_path, capsys, monkeypatch):
    model = Path(shutil.copytree(output.parent / "model", tmp_path / "model"))
    before = _digests(model)
    monkeypatch.setattr(trace_cli, "load_for_tracing", _never)
    assert main(["trace", "--model", str(model), "--graph", str(model / where)]) == 2
    assert str(model / where) in capsys.readouterr().err and _digests(model) == before


def test_trace_graph_without_graphviz_checks_the_dot_file_it_falls_back_to(output, tmp_path, capsys, monkeypatch):
    (tmp_path / "g.dot").write_text("mine")
    monkeypatch.setattr(trace_cli.shutil, "which", lambda name: None)  # no graphviz here
    monkeypatch.setattr(trace_cli, "load_for_tracing", _never)
    assert main(["trace", "--model", str(output.parent / "model"), "--graph", str(tmp_path / "g.svg")]) == 2
    assert "g.dot' exists" in capsys.readouterr().err and (tmp_path / "g.dot").read_text() == "mine"


@pytest.mark.parametrize(("where", "problem"), [
    ("heldout.txt", "heldout.txt' exists"),
    ("model/config.json", "config.json' exists"),
    ("model/kl.svg", "lies inside the original model folder"),
    ("out/kl.svg", "lies inside the compressed model folder"),
])
def test_eval_svg_is_refused_before_the_windows_run(where, problem, output, tmp_path, capsys, monkeypatch):
    root = Path(shutil.copytree(output.parent, tmp_path / "root"))
    (root / "heldout.txt").write_text("w1 w2 w3 w4\n")
    monkeypatch.setattr(evaluation, "evaluate", _never)
    before = {name: _digests(root / name) for name in ("model", "out")}
    argv = ["eval", str(root / "model"), str(root / "out"), "--dataset", str(root / "heldout.txt"),
            "--svg", str(root / where), "--quiet"]
    assert main(argv) == 2
    assert problem in capsys.readouterr().err
    assert {name: _digests(root / name) for name in ("model", "out")} == before
    assert (root / "heldout.txt").read_text() == "w1 w2 w3 w4\n"
