"""Writing an output folder atomically: all of it appears at once, or none of it.

:func:`atomic_output_dir` hands out a hidden temporary folder next to the target
(same file system, so the final step is a rename). On success the temporary
folder is renamed into place; on any error or KeyboardInterrupt it is removed
and an existing target folder is left exactly as it was, as are the folders above it
(parents created for the output are removed again). A finished folder is never removed:
when the last step cannot happen (a folder appeared at the target while the run worked),
it is kept as ``OUT.complete-<time>`` beside the target (:class:`OutputKeptAsideError` says
where). A target that is a symbolic link is written where the link points.

:func:`check_output_dir` runs before any work (``compress()`` calls it before loading
the model): an existing folder without ``overwrite``, or a location that cannot be
written, fails in seconds, not after an hour of calibration. :func:`reserve_output`
claims the output for the whole run (a lock with our PID, see ``output_lock``), so a
second run aiming at it fails at once and a killed run's debris is removed.

Two rules keep a user's data safe, whatever the flags:

* **an output never destroys an input** (:func:`check_not_an_input`): an output folder that
  is, holds or lies inside the model's folder, or is or holds the dataset or recipe file, is
  refused, ``overwrite`` or not;
* **overwrite replaces only what layerwise wrote**: ``overwrite=True`` replaces a folder that
  holds :data:`OWNER_MARK` (every ``compress`` output does); any other non-empty folder needs
  ``overwrite="any"`` (CLI: ``--overwrite-any``). A ``README.md`` the user wrote into a layerwise
  output (one that is not layerwise's model card, :mod:`layerwise.reports.model_card`) is carried
  into the folder that replaces it, in place of the new card.

A write the operating system refuses while the folder is written (disk full, a file over the
size limit, a read-only disk, no permission) is an :class:`OutputNotWritableError` that names
the folder, the reason and the fix (:func:`write_failures_named`): the raw ``OSError`` or
``SafetensorError`` reads like a bug in layerwise.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from layerwise.common.files import FileWriteError, replace_file, size_text
from layerwise.errors import LayerwiseError
from layerwise.model_io.output_leftovers import warn_about_leftovers
from layerwise.model_io.output_lock import (  # noqa: F401 - OutputLockedError re-exported
    OutputLockedError,
    claim,
    default_folder_mode,
    old_prefix,
    release,
)


class OutputExistsError(LayerwiseError, FileExistsError):
    """The output folder exists, is not empty, and overwriting was not asked for."""


class OutputNotWritableError(LayerwiseError, OSError):
    """The output folder cannot be created where it was asked for (read-only, no permission, a file)."""


class OutputIsInputError(LayerwiseError, ValueError):
    """The output folder is, holds or lies inside one of the run's inputs: writing it could destroy them."""


class OutputKeptAsideError(LayerwiseError, OSError):
    """The run finished but its folder could not be put in place: it is kept, complete, beside the target.

    ``kept``: where the finished output is; ``target``: where it was meant to go.
    """

    def __init__(self, message: str, kept: Path, target: Path) -> None:
        super().__init__(message)
        self.kept, self.target = kept, target


#: why the operating system refused a write, by ``errno``, and the fix
WRITE_FAILURES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("the disk is full", "free space on that disk, or choose a folder on a disk with room"),
    errno.EDQUOT: ("the disk quota is used up", "free space within your quota, or choose a folder on another disk"),
    errno.EFBIG: ("a file grew past the largest size this process or its file system allows, e.g. `ulimit -f` or "
                  "a FAT32 disk's 4 GiB", "raise the limit (`ulimit -f unlimited`), or choose a folder on another "
                                          "file system"),
    errno.EROFS: ("the file system is read-only", "choose a folder on a writable disk"),
    errno.EACCES: ("permission denied", "choose a folder you can write to, or change that folder's permissions"),
    errno.EPERM: ("operation not permitted", "choose a folder you can write to, or change that folder's permissions"),
}
#: how safetensors (Rust) reports an I/O error: ``... I/O error: File too large (os error 27)``
_RUST_IO_ERROR = re.compile(r"I/O error: (.*?) \(os error (\d+)\)")

log = logging.getLogger("layerwise")

#: ``False``: refuse a non-empty folder; ``True``: replace one layerwise wrote; ``"any"``: replace any folder
Overwrite = bool | Literal["any"]

#: the file that marks a folder as a layerwise output (``compress`` writes its run summary into every one)
OWNER_MARK = "layerwise_summary.json"


def written_by_layerwise(folder: Path) -> bool:
    """Whether ``folder`` is a layerwise output (it holds :data:`OWNER_MARK`)."""
    return (folder / OWNER_MARK).is_file()


def output_target(path: str | os.PathLike) -> Path:
    """The folder ``path`` names, as an absolute path; a symbolic link is followed, so the output is written
    where it points and the link keeps working (replacing the link would put it beside the link instead)."""
    target = Path(path).expanduser().absolute()
    return Path(os.path.realpath(target)) if target.is_symlink() else target


def check_overwrite(overwrite: object) -> None:
    """``overwrite`` is ``False``, ``True`` (replace a folder layerwise wrote) or ``"any"``."""
    if overwrite not in (False, True, "any"):
        from layerwise.errors import InvalidArgumentError

        raise InvalidArgumentError(f"overwrite={overwrite!r}: use False, True (replace a folder layerwise wrote) "
                                   f"or 'any' (replace any folder)")


def check_output_dir(path: str | os.PathLike, overwrite: Overwrite = False,
                     owned: Callable[[Path], bool] = written_by_layerwise) -> Path:
    """The target as a Path; raises when it cannot (or may not) be written.

    ``owned`` says whether an existing folder is one ``overwrite=True`` may replace.
    """
    check_overwrite(overwrite)
    target = output_target(path)
    if target.exists() and not target.is_dir():
        raise OutputExistsError(f"output path '{target}' exists and is not a folder; choose another output_dir")
    if target.is_dir() and any(target.iterdir()):
        if not overwrite:
            raise OutputExistsError(f"output folder '{target}' already exists and is not empty; pass overwrite=True "
                                    f"(CLI: --overwrite) to replace it, or choose another output_dir")
        if overwrite is True and not owned(target):
            raise OutputExistsError(
                f"output folder '{target}' was not written by layerwise (it holds {_some_entries(target)} and no "
                f"{OWNER_MARK}): --overwrite replaces only a layerwise output. Choose another output_dir, or pass "
                f"overwrite='any' (CLI: --overwrite-any) to delete what it holds and write the model there")
    _check_writable(target)
    return target


def _some_entries(folder: Path, shown: int = 3) -> str:
    names = sorted(entry.name + ("/" if entry.is_dir() else "") for entry in folder.iterdir())
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(repr(name) for name in names[:shown]) + more


def check_not_an_input(path: str | os.PathLike, inputs: Iterable[tuple[str, str | os.PathLike]]) -> None:
    """Refuse an output folder that would write over one of the run's inputs, ``overwrite`` or not.

    ``inputs`` are ``(what, path)`` pairs such as ``("model folder", "llama")`` or ``("dataset file",
    "calib.txt")``. The output may not be an input, hold one (replacing it would delete the input), or
    lie inside an input folder (it would write into the model). Paths are compared after symlinks are
    followed. An output beside an input file is fine: writing it touches nothing else.
    """
    target = _real(path)
    for what, where in inputs:
        source = _real(where)
        if target == source:
            problem = f"is the {what}"
        elif source.is_relative_to(target):
            problem = f"holds the {what} '{where}'"
        elif source.is_dir() and target.is_relative_to(source):
            problem = f"lies inside the {what} '{where}'"
        else:
            linked = next((link for link, real in _links_within(source) if real.is_relative_to(target)), None)
            if linked is None:
                continue
            problem = (f"holds the file '{os.path.realpath(linked)}' that the {what}'s '{linked.name}' links to "
                       f"(a Hugging Face cache keeps a snapshot's files as links into its blobs folder)")
        raise OutputIsInputError(f"output folder '{path}' {problem}: writing it would destroy the run's input "
                                 f"(overwrite or not). Choose an output_dir outside it (CLI: --output-dir), e.g. "
                                 f"'{_sibling(source)}'")


def _links_within(folder: Path) -> Iterator[tuple[Path, Path]]:
    """``(link, resolved)`` for every symbolic link below ``folder`` (not descending into linked folders):
    an input folder's files may live elsewhere, and replacing that place destroys them as surely."""
    if not folder.is_dir():
        return
    for parent, folders, files in os.walk(folder):
        for name in folders + files:
            entry = Path(parent) / name
            if entry.is_symlink():
                yield entry, _real(entry)


def run_inputs(model: Any, dataset: Any, recipe: Any) -> list[tuple[str, str]]:
    """The files and folders a run reads that exist on this machine: its output must not touch them.

    A loaded module counts its source folder (``config._name_or_path``) when that is a local folder.
    """
    found = []
    if not isinstance(model, (str, os.PathLike)):
        model = getattr(getattr(model, "config", None), "_name_or_path", None)
        found.append(("model's source folder", model))
    else:
        found.append(("model folder", model))
    found += [("dataset file", dataset), ("recipe file", recipe)]
    return [(what, str(where)) for what, where in found
            if isinstance(where, (str, os.PathLike)) and str(where) and _exists(where)]


def _exists(where: str | os.PathLike) -> bool:
    try:  # a recipe's YAML text is no path; a very long one makes the file system refuse the name
        return Path(where).expanduser().exists()
    except OSError:
        return False


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(Path(path).expanduser()))


def _sibling(source: Path) -> Path:
    """A suggested output folder next to ``source``."""
    return source.parent / f"{source.stem or source.name}-compressed"


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


#: output folders this process has claimed, and their locked temporary folders
_RESERVED: dict[Path, Path] = {}


@contextlib.contextmanager
def reserve_output(path: str | os.PathLike, overwrite: Overwrite = False, resume: bool = False) -> Iterator[Path]:
    """Claim ``path`` for this run: yield its locked temporary sibling, removed on exit.

    ``compress()`` claims the output before loading the model, so a second run aiming at
    it fails in seconds (:class:`OutputLockedError`); :func:`atomic_output_dir` inside the
    claim writes into the same folder. Parents created for it are removed again on failure.
    """
    target = output_target(path)
    if target in _RESERVED:  # claimed (and checked) further up this call stack
        yield _RESERVED[target]
        return
    check_output_dir(target, overwrite)
    existing = _nearest_existing(target.parent)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = claim(target, held=set(_RESERVED.values()), resume=resume)
        _RESERVED[target] = tmp
        warn_about_leftovers(target)  # a killed run's last renames: said, never deleted
        keep = False
        try:
            yield tmp
        except BaseException as exc:  # a finished output kept aside is the user's now, as is a checkpoint
            keep = isinstance(exc, OutputKeptAsideError) or _keep_checkpoint(tmp, exc)
            raise
        finally:
            del _RESERVED[target]
            if not keep:
                shutil.rmtree(tmp, ignore_errors=True)  # already gone once it became the output
    except BaseException:
        _remove_empty_parents(target.parent, existing)
        raise


def _keep_checkpoint(tmp: Path, failure: BaseException) -> bool:
    """A failed run's folder holding a resume checkpoint stays (unlocked) for ``resume=True`` to continue
    (a checkpoint that cannot be continued too: its error says what to do, never to resume it).

    Never raises: it runs while the run's own error is on its way to the user (a full disk, most
    likely), and that error is the one they must see.
    """
    from layerwise.model_io.output_lock import LOCK_FILE
    from layerwise.model_io.resume import ResumeError, describe, has_checkpoint

    try:
        if not has_checkpoint(tmp):
            return False
    except OSError:
        return False
    try:  # through a rename: a failed write leaves the lock naming this process, which ends now
        replace_file(tmp / LOCK_FILE, "0\n")  # no live owner: the next run reports it, or takes it over
    except OSError as exc:
        log.warning("layerwise: could not mark the checkpoint in '%s' as free (%s); its lock names this process, "
                    "which a later run finds ended", tmp, exc.strerror or exc)
    if isinstance(failure, ResumeError):  # its own error says what to do with it
        return True
    log.warning("layerwise: the run stopped %s; its checkpoint is kept in '%s': the command that made it, run "
                "again with resume=True (CLI: --resume), continues it", describe(tmp), tmp)
    return True


#: the output folders this process has written (renamed into place), in order
_WRITTEN: list[Path] = []


def outputs_written() -> list[Path]:
    """The output folders this process has written, in order: what an interruption after them leaves complete."""
    return list(_WRITTEN)


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, overwrite: Overwrite = False) -> Iterator[Path]:
    """Yield a temporary folder; on success it becomes ``path`` in one rename.

    An existing non-empty ``path`` is refused unless ``overwrite`` allows it (``True``: a
    layerwise output; ``"any"``: any folder), in which case it is replaced only after
    everything was written. The output gets the
    user's default folder mode (umask), not the 0700 of a temporary folder. A write the operating
    system refuses is an :class:`OutputNotWritableError` (:func:`write_failures_named`).
    """
    target = output_target(path)
    with write_failures_named(target), reserve_output(path, overwrite) as tmp:
        yield tmp
        release(tmp)
        give_default_modes(tmp)
        _move_into_place(tmp, target, overwrite)
        _WRITTEN.append(target)


@contextlib.contextmanager
def write_failures_named(target: Path, named_only: bool = False) -> Iterator[None]:
    """Inside, a write to ``target`` (or its temporary sibling) that the operating system refuses becomes an
    :class:`OutputNotWritableError` with the reason and the fix; anything else passes unchanged.

    ``named_only``: an ``OSError`` naming no file is not taken for the output's (around a whole run, where
    a download or a library may fail too; layerwise's own writes name their files).
    """
    try:
        yield
    except LayerwiseError:
        raise
    except Exception as exc:
        failure = write_failure(exc, target.parent, named_only)
        if failure is None:
            raise
        reason, fix = failure
        raise OutputNotWritableError(
            f"cannot write output folder '{target}': {reason}; it was not written (a folder there before is left "
            f"as it was). Fix: {fix} (output_dir=, CLI: --output-dir), then run again") from exc


def write_failure(exc: BaseException, where: Path, named_only: bool = False) -> tuple[str, str] | None:
    """``(reason, fix)`` when ``exc`` is the operating system refusing a write below ``where``, else ``None``.

    An ``OSError`` naming a file elsewhere (a model file being read), or with ``named_only`` naming none, is
    not the output's.
    """
    if isinstance(exc, OSError):
        code, text = exc.errno, exc.strerror or str(exc)
        if not exc.filename and named_only:
            return None
        if exc.filename and not _real(exc.filename).is_relative_to(_real(where)):
            return None
    elif type(exc).__name__ == "SafetensorError" and (found := _RUST_IO_ERROR.search(str(exc))):
        code, text = int(found.group(2)), found.group(1)
    else:
        return None
    if code not in WRITE_FAILURES:
        return None
    reason, fix = WRITE_FAILURES[code]
    return f"{reason} ({text}){_while_writing(exc)}", fix


def _while_writing(exc: BaseException) -> str:
    """`` while writing 'part-00002.safetensors' (12.0 MiB)`` when the error says which file and its size."""
    if not isinstance(exc, FileWriteError) or exc.nbytes is None:
        return ""
    return f" while writing '{Path(exc.filename).name}' ({size_text(exc.nbytes)})"


def give_default_modes(folder: Path) -> None:
    """The folder, its subfolders and files get the modes the user's umask gives new ones.

    Temporary files (``mkstemp``, used by writers that rename into place) are 0600 and the
    temporary folder 0700: a server running as another user could not read the checkpoint.
    """
    folder_mode = default_folder_mode()
    file_mode = folder_mode & 0o666
    for root, folders, files in os.walk(folder):
        for name in folders:
            os.chmod(os.path.join(root, name), folder_mode)
        for name in files:
            os.chmod(os.path.join(root, name), file_mode)
    os.chmod(folder, folder_mode)


def _remove_empty_parents(folder: Path, stop: Path) -> None:
    """Remove the folders created for the output, up to (not including) ``stop``, while empty."""
    while folder != stop and stop in folder.parents:
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent


def _move_into_place(tmp: Path, target: Path, overwrite: Overwrite) -> None:
    """Make the finished ``tmp`` the output; when that cannot be done, keep it aside (it is never deleted)."""
    try:
        check_output_dir(target, overwrite)  # something may have appeared while we wrote
        _replace_target(tmp, target)
    except (LayerwiseError, OSError) as exc:
        kept = _keep_finished(tmp, target)
        raise OutputKeptAsideError(
            f"the run finished, but its output could not be put in place: {_why_not_in_place(target, exc)}. "
            f"Nothing was deleted: the finished output is kept, complete, in '{kept}'. Use it from there, or "
            f"move '{target}' out of the way and put it in place (e.g. mv '{kept}' '{target}'); running again "
            f"with --overwrite would compute it all again", kept, target) from exc


def _replace_target(tmp: Path, target: Path) -> None:
    if not target.exists():
        os.rename(tmp, target)
        return
    if not any(target.iterdir()):
        target.rmdir()
        os.rename(tmp, target)
        return
    _carry_user_readme(target, tmp)
    old = Path(tempfile.mkdtemp(prefix=f"{old_prefix(target)}{os.getpid()}-", dir=target.parent))
    old.rmdir()
    os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(old, target)  # put the previous folder back
        raise
    _remove_replaced(old)


def _remove_replaced(old: Path) -> None:
    """Delete the folder the new output replaced; what cannot be deleted is named, never left unnoticed."""
    if old.is_symlink() or not old.is_dir():
        old.unlink(missing_ok=True)
    else:
        shutil.rmtree(old, ignore_errors=True)
    if os.path.lexists(old):
        log.warning("layerwise: the replaced output could not be deleted completely; delete '%s' yourself", old)


def _why_not_in_place(target: Path, exc: BaseException) -> str:
    if isinstance(exc, OutputExistsError) and target.is_dir():
        return f"'{target}' appeared or filled while the run worked (it holds {_some_entries(target)})"
    if isinstance(exc, OutputExistsError):
        return f"'{target}' appeared while the run worked and is not a folder"
    return f"'{target}' could not be written ({getattr(exc, 'strerror', None) or exc})"


def _keep_finished(tmp: Path, target: Path) -> Path:
    """Rename a finished folder to ``OUT.complete-<time>`` beside the target; where even that fails it stays
    where it is (unlocked: no later run removes a folder without a lock)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for attempt in range(100):
        kept = target.parent / (f"{target.name}.complete-{stamp}" + (f"-{attempt}" if attempt else ""))
        if os.path.lexists(kept):
            continue
        try:
            os.rename(tmp, kept)
        except OSError:
            return tmp
        return kept
    return tmp


def _carry_user_readme(target: Path, tmp: Path) -> None:
    """Keep the README.md a user wrote into a layerwise output: it replaces the new folder's card."""
    from layerwise.reports.model_card import CARD_FILE, is_layerwise_card

    readme = target / CARD_FILE
    if written_by_layerwise(target) and readme.is_file() and not is_layerwise_card(readme):
        shutil.copy2(readme, tmp / CARD_FILE)
