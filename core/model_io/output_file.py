"""Writing one output file (a chart, a graph) that destroys nothing: ``report --svg``, ``eval --svg``,
``trace --graph``.

:func:`check_output_file` runs before the work that makes the file: a path that exists is refused,
whatever it holds (a model's config.json or weights, the run summary, the dataset), and so is a
path inside a model folder the command reads (a stray file there changes what the folder holds).
:func:`write_output_file` writes through a temporary file and a rename: a failed write leaves
nothing behind, never half a file.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from layerwise.common.files import replace_file
from layerwise.model_io.saving import (
    OutputExistsError,
    OutputIsInputError,
    OutputNotWritableError,
    write_failure,
)


def check_output_file(path: str | os.PathLike, what: str,
                      input_folders: Iterable[tuple[str, str | os.PathLike]] = ()) -> Path:
    """``path`` as a Path when ``what`` (``"the SVG chart"``) may be written there, else a named error.

    ``input_folders`` are ``(what, folder)`` pairs such as ``("model folder", "llama")``; one that is no
    local folder (a hub id) is skipped. Symbolic links are followed, as the write would follow them.
    """
    target = Path(path).expanduser()
    if target.exists() or target.is_symlink():
        raise OutputExistsError(f"'{path}' exists: choose another name for {what} or delete it first (an output "
                                f"never replaces a file)")
    real = Path(os.path.realpath(target))
    for name, folder in input_folders:
        source = Path(os.path.realpath(Path(folder).expanduser()))
        if source.is_dir() and real.is_relative_to(source):
            raise OutputIsInputError(f"'{path}' lies inside the {name} '{folder}': a file written there changes what "
                                     f"the folder holds; choose a path for {what} outside it")
    _check_folder_writable(target, what)
    return target


def write_output_file(path: Path, content: str | bytes, what: str) -> None:
    """Write ``content`` to ``path`` whole or not at all; a path that appeared since it was checked stays."""
    check_output_file(path, what)
    try:
        replace_file(path, content)
    except OSError as exc:
        reason, fix = write_failure(exc, path.parent) or (exc.strerror or str(exc), "choose a path in a folder you "
                                                                                    "can write to")
        raise OutputNotWritableError(f"cannot write {what} to '{path}': {reason}; nothing was written. Fix: {fix}"
                                     ) from exc


def _check_folder_writable(target: Path, what: str) -> None:
    """Create and remove a file in the folder ``target`` goes in: the only check right for root, ACLs and
    read-only mounts alike."""
    folder = target.parent
    if not folder.is_dir():
        raise OutputNotWritableError(f"cannot write {what} to '{target}': folder '{folder}' does not exist; create "
                                     f"it, or choose a path in a folder you can write to")
    try:
        handle, probe = tempfile.mkstemp(prefix=f".{target.name}.probe-", dir=folder)
        os.close(handle)
        os.unlink(probe)
    except OSError as exc:
        raise OutputNotWritableError(f"cannot write {what} to '{target}': folder '{folder}' is not writable "
                                     f"({exc.strerror or exc}); choose a path in a folder you can write to"
                                     ) from exc
