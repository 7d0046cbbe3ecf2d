"""One run per output folder: a lock file naming the owner process in its temporary sibling.

A run claims ``out`` by creating ``.out.incomplete-XXXX/`` next to it with a
:data:`LOCK_FILE` that holds its PID, then its host, boot, PID namespace and start time
(:func:`~layerwise.common.processes.process_identity`). Another run aiming at the same ``out`` sees a
sibling whose owner is alive and fails at once (:class:`OutputLockedError`), instead of
calibrating for an hour and then racing the first run's rename. A sibling whose owner is
dead is debris of a killed run and is removed. An owner on another machine or in another
container (a shared file system) cannot be checked from here: it counts as alive, never removed.
The new folder is created *before* the others are looked at, so two runs starting together
cannot both miss each other.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path

from layerwise.common.processes import owner_record, owner_state, read_owner_record
from layerwise.errors import LayerwiseError

#: the lock inside a temporary output folder; removed before the folder becomes the output
LOCK_FILE = ".layerwise.lock"


class OutputLockedError(LayerwiseError):
    """Another live run is writing the same output folder."""


def incomplete_prefix(target: Path) -> str:
    """The name prefix of ``target``'s temporary siblings."""
    return f".{target.name}.incomplete-"


def old_prefix(target: Path) -> str:
    """The name prefix of the folder ``target`` is renamed to while a finished output replaces it (the PID of
    the run replacing it follows)."""
    return f".{target.name}.old-"


def lock_owner(folder: Path) -> int | None:
    """The PID in ``folder``'s lock file; ``None`` without a readable one."""
    return _read_lock(folder)[0]


def _read_lock(folder: Path) -> tuple[int | None, dict[str, str]]:
    """The PID and the identity lines of ``folder``'s lock file (none in a lock holding the PID alone)."""
    try:
        return read_owner_record((folder / LOCK_FILE).read_text())
    except OSError:
        return None, {}


def claim(target: Path, held: Collection[Path] = (), resume: bool = False) -> Path:
    """A new locked temporary sibling of ``target``; stale siblings are removed on the way.

    ``held``: siblings this process holds already (not a conflict). Raises
    :class:`OutputLockedError` when another live run holds one. A dead run's sibling holding a
    resume checkpoint (:mod:`layerwise.model_io.resume`) is never removed: with ``resume`` it is taken
    over and returned, without it is reported (:class:`~layerwise.model_io.resume.ResumeError`).
    """
    from layerwise.model_io.resume import ResumeError, describe, has_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix=incomplete_prefix(target), dir=target.parent))
    try:
        (tmp / LOCK_FILE).write_text(owner_record())
        for other in sorted(target.parent.glob(incomplete_prefix(target) + "*")):
            if other == tmp or other in held or not other.is_dir():
                continue
            owner, where = _read_lock(other)
            if owner is None:  # written by a version without locks, or being created now: leave it
                continue
            state = owner_state(owner, where)
            if state == "alive":
                raise OutputLockedError(
                    f"output folder '{target}' is being written by another run (process {owner}, "
                    f"temporary folder '{other}'); wait for it to finish, or choose another output_dir "
                    f"(CLI: --output-dir). If process {owner} is not layerwise, delete '{other}'")
            if state == "elsewhere":
                raise OutputLockedError(
                    f"output folder '{target}' is being written by process {owner} on "
                    f"{where.get('host', 'another machine')!r} (another machine or container: whether it still "
                    f"runs cannot be checked from here; temporary folder '{other}'); wait for it to finish, "
                    f"or choose another output_dir (CLI: --output-dir). If that run is over, delete '{other}'")
            if has_checkpoint(other):
                if not resume:
                    raise ResumeError(
                        f"an interrupted run of output folder '{target}' left a checkpoint in '{other}' "
                        f"({describe(other) or 'unreadable progress'}): pass resume=True (CLI: --resume) to "
                        f"continue it, or delete that folder to start over")
                (other / LOCK_FILE).write_text(owner_record())  # taken over: this run continues it
                shutil.rmtree(tmp, ignore_errors=True)
                return other
            shutil.rmtree(other, ignore_errors=True)  # its run was killed before it could clean up
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def release(tmp: Path) -> None:
    """Remove the lock from a finished temporary folder (before it becomes the output)."""
    try:
        (tmp / LOCK_FILE).unlink()
    except FileNotFoundError:
        pass


def default_folder_mode() -> int:
    """The mode a new folder gets from the user's umask (``mkdtemp`` makes 0700 ones)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask
