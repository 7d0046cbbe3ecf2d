"""Writing an output folder atomically: all of it appears at once, or none of it.

:func:`atomic_output_dir` hands out a hidden temporary folder next to the target
(same file system, so the final step is a rename). On success the temporary
folder is renamed into place; on any error or KeyboardInterrupt it is removed
and an existing target folder is left exactly as it was, as are the folders above it
(parents created for the output are removed again).

:func:`check_output_dir` runs before any work (``compress()`` calls it before loading
the model): an existing folder without ``overwrite``, or a location that cannot be
written, fails in seconds, not after an hour of calibration.
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


class OutputNotWritableError(LayerwiseError, OSError):
    """The output folder cannot be created where it was asked for (read-only, no permission, a file)."""


def check_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """The target as a Path; raises when it cannot (or may not) be written."""
    target = Path(path).expanduser().absolute()
    if target.exists() and not target.is_dir():
        raise OutputExistsError(f"output path '{target}' exists and is not a folder; choose another output_dir")
    if target.is_dir() and any(target.iterdir()) and not overwrite:
        raise OutputExistsError(f"output folder '{target}' already exists and is not empty; pass overwrite=True "
                                f"(CLI: --overwrite) to replace it, or choose another output_dir")
    _check_writable(target)
    return target


def _check_writable(target: Path) -> None:
    """Create and remove a folder where the output's temporary folder will go.

    Trying is the only check that is right for root, ACLs and read-only mounts alike.
    """
    existing = _nearest_existing(target.parent)
    if not existing.is_dir():
        raise OutputNotWritableError(f"cannot create output folder '{target}': '{existing}' is a file, not a "
                                     f"folder; choose another output_dir")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{target.name}.probe-", dir=existing))
    except OSError as exc:
        raise OutputNotWritableError(
            f"cannot write output folder '{target}': '{existing}' is not writable ({exc.strerror or exc}); "
            f"choose an output_dir you can write to, or change that folder's permissions") from exc


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``path`` in one rename.

    An existing non-empty ``path`` is refused unless ``overwrite=True``, in which
    case it is replaced only after everything was written.
    """
    target = check_output_dir(path, overwrite)
    existing = _nearest_existing(target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.incomplete-", dir=target.parent))
        try:
            yield tmp
            _move_into_place(tmp, target, overwrite)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    except BaseException:
        _remove_empty_parents(target.parent, existing)
        raise


def _remove_empty_parents(folder: Path, stop: Path) -> None:
    """Remove the folders created for the output, up to (not including) ``stop``, while empty."""
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


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
