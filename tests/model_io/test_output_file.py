"""One output file (``report --svg``, ``eval --svg``, ``trace --graph``): never over a file, never into a model
folder, written whole or not at all."""

from __future__ import annotations

import pytest

from layerwise.model_io import output_file
from layerwise.model_io.output_file import check_output_file, write_output_file
from layerwise.model_io.saving import OutputExistsError, OutputIsInputError, OutputNotWritableError


def test_an_existing_file_is_refused_and_left_as_it_was(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"weights")
    with pytest.raises(OutputExistsError, match="model.safetensors' exists: choose another name for the chart or "
                                                "delete it first"):
        check_output_file(weights, "the chart")
    assert weights.read_bytes() == b"weights"


def test_a_link_to_a_file_is_refused_too(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "chart.svg").symlink_to(tmp_path / "config.json")
    with pytest.raises(OutputExistsError):
        check_output_file(tmp_path / "chart.svg", "the chart")


def test_a_new_file_inside_an_input_folder_is_refused(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    with pytest.raises(OutputIsInputError, match="lies inside the model folder"):
        check_output_file(model / "graph.dot", "the graph", [("model folder", model)])
    assert check_output_file(tmp_path / "graph.dot", "the graph", [("model folder", model), ("hub id", "org/x")]) \
        == tmp_path / "graph.dot"


def test_a_missing_folder_is_named_before_any_work(tmp_path):
    with pytest.raises(OutputNotWritableError, match="folder '.*no' does not exist"):
        check_output_file(tmp_path / "no" / "x.svg", "the chart")


def test_the_file_is_written_whole(tmp_path):
    write_output_file(tmp_path / "x.svg", "<svg/>", "the chart")
    write_output_file(tmp_path / "x.png", b"\x89PNG", "the chart")
    assert (tmp_path / "x.svg").read_text() == "<svg/>" and (tmp_path / "x.png").read_bytes() == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.png", "x.svg"]


def test_a_failed_write_leaves_nothing_and_says_why(tmp_path, monkeypatch):
    import errno

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_file.os, "replace", full)
    with pytest.raises(OutputNotWritableError, match="cannot write the chart to .*the disk is full.*nothing was "
                                                     "written"):
        write_output_file(tmp_path / "x.svg", "<svg/>", "the chart")
    assert list(tmp_path.iterdir()) == []


def test_a_file_that_appeared_since_the_check_is_not_replaced(tmp_path):
    target = check_output_file(tmp_path / "x.svg", "the chart")
    target.write_text("someone else's")
    with pytest.raises(OutputExistsError):
        write_output_file(target, "<svg/>", "the chart")
    assert target.read_text() == "someone else's"
