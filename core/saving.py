"""Writing an output folder atomically: all of it appears at once, or none of it.

:func:`atomic_output_dir` hands out a hidden temporary folder next to the target
(same file system, so the final step is a rename). On success the temporary
folder is renamed into place; on any error or KeyboardInterrupt it is removed
and an existing target folder is left exactly as it was.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import LayerwiseError


class OutputExistsError(LayerwiseError, FileExistsError):
    """The output folder exists, is not empty, and overwriting was not asked for."""


def check_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """The target as a Path; raises when it cannot (or may not) be written."""
    target = Path(path).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise OutputExistsError(f"output path '{target}' exists and is not a folder; choose another output_dir")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise OutputExistsError(f"output folder '{target}' already exists and is not empty; pass overwrite=True "
                                f"(CLI: --overwrite) to replace it, or choose another output_dir")
    return target


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``path`` in one rename.

    An existing non-empty ``path`` is refused unless ``overwrite=True``, in which
    case it is replaced only after everything was written.
    """
    target = check_output_dir(path, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.incomplete-", dir=target.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _move_into_place(tmp, target, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _move_into_place(tmp: Path, target: Path, overwrite: bool) -> None:
    check_output_dir(target, overwrite)  # something may have appeared while we wrote
    if not target.exists():
        os.rename(tmp, target)
        return
    if not any(target.iterdir()):
        target.rmdir()
        os.rename(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    old.rmdir()
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)  # put the previous folder back
        raise
    shutil.rmtree(old, ignore_errors=True)
