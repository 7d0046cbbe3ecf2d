"""replace_file: the old file or the new one, never a part, and no temporary file left behind."""

from __future__ import annotations

import os

import pytest

from layerwise.common.files import replace_file


def test_text_and_bytes_replace_the_file_whole(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    replace_file(path, "new")
    assert path.read_text() == "new"
    replace_file(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_a_failed_rename_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    path.write_text("old")

    def refuse(source, destination):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="No space left"):
        replace_file(path, "new")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
