"""replace_file and write_through: the old file or the new one, never a part; a refused write names its file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from layerwise.common.files import (
    FileWriteError,
    is_disk_full,
    naming_the_file,
    replace_file,
    write_through,
)


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


def _refusing_write(*args, **kwargs):
    raise OSError(28, "No space left on device")  # what a write on an open file raises: no file named


def test_a_refused_write_names_the_file_and_its_size(tmp_path, monkeypatch):
    path = tmp_path / "summary.json"
    monkeypatch.setattr(Path, "write_bytes", _refusing_write)
    with pytest.raises(FileWriteError) as info:
        replace_file(path, "four")
    assert info.value.filename == str(path) and info.value.nbytes == 4 and is_disk_full(info.value)
    assert list(tmp_path.iterdir()) == []


def test_an_error_naming_its_file_or_no_errno_passes_unchanged(tmp_path):
    named = OSError(28, "No space left on device", "/elsewhere/file")
    with pytest.raises(OSError) as info, naming_the_file(tmp_path / "mine"):
        raise named
    assert info.value is named
    ours = OSError("the source ended 8 bytes before its tensor's end")
    with pytest.raises(OSError) as info, naming_the_file(tmp_path / "mine"):
        raise ours
    assert info.value is ours


def test_write_through_leaves_no_part_of_a_file_the_disk_had_no_room_for(tmp_path):
    path = tmp_path / "b0-1.pt"

    def half_then_full(handle):
        handle.write(b"half")
        handle.flush()
        _refusing_write()

    with pytest.raises(FileWriteError, match="No space left") as info:
        write_through(path, half_then_full, nbytes=8)
    assert info.value.filename == str(path) and not path.exists()


def test_torch_save_through_write_through_fails_as_an_os_error_naming_the_file(tmp_path):
    """A real refused write (``ulimit -f``): ``torch.save`` to a path would say ``unexpected pos`` (a RuntimeError)."""
    import errno
    import resource

    import torch

    path = tmp_path / "b0-1.pt"
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # Python ignores SIGXFSZ: writes fail, EFBIG
    try:
        with pytest.raises(FileWriteError) as info:
            write_through(path, lambda handle: torch.save(torch.zeros(2**16), handle), nbytes=2**18)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert info.value.errno == errno.EFBIG and info.value.filename == str(path) and not path.exists()
