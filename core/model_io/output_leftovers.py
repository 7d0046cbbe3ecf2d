"""What a run killed while putting its output in place leaves beside it, said to the next one that looks.

An output ``OUT`` is put in place by renames (:func:`~layerwise.model_io.saving.atomic_output_dir`): the
finished ``.OUT.incomplete-XXXX`` loses its lock, the folder it replaces (if any) becomes
``.OUT.old-<pid>-XXXX``, the finished one becomes ``OUT``, and the old one is deleted last. A run killed
in between leaves, silently:

* ``.OUT.old-*`` while ``OUT`` is missing: the previous complete output, its only copy;
* ``.OUT.old-*`` beside ``OUT``: the folder ``OUT`` replaced, its deletion cut short;
* an unlocked ``.OUT.incomplete-*`` holding files: a finished output never put in place (a lock is
  only removed right before the rename; a killed run's locked folder is debris the next run removes).

Nothing here deletes any of them: which one to keep is the user's call. The next run writing ``OUT``
warns (:func:`warn_about_leftovers`), and a command reading a missing ``OUT`` names the folder to move
into place (:func:`missing_output_hint`). An ``.old`` folder whose owner (the PID in its name) still runs
is a run finishing its rename, not a leftover.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from layerwise.common.processes import owner_state
from layerwise.common.user_warnings import warn_user
from layerwise.model_io.output_lock import LOCK_FILE, incomplete_prefix, old_prefix


class OutputLeftoverWarning(UserWarning):
    """A killed run left folders beside an output: the message says what each holds and what to do."""


@dataclass(frozen=True)
class Leftovers:
    """The folders a killed run left beside ``target``."""

    target: Path
    #: ``.OUT.old-*``: the output a run was replacing
    replaced: tuple[Path, ...] = ()
    #: unlocked ``.OUT.incomplete-*`` holding files: finished outputs never put in place
    finished: tuple[Path, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.replaced or self.finished)


def find_leftovers(target: Path) -> Leftovers:
    """The leftovers of killed runs beside ``target`` (none when its folder cannot be read)."""
    try:
        siblings = sorted(target.parent.iterdir())
    except OSError:
        return Leftovers(target)
    replaced = tuple(p for p in siblings if p.name.startswith(old_prefix(target)) and _owner_gone(p, target))
    finished = tuple(p for p in siblings if p.name.startswith(incomplete_prefix(target)) and _unlocked_with_files(p))
    return Leftovers(target, replaced, finished)


def _owner_gone(folder: Path, target: Path) -> bool:
    """Whether no live process owns an ``.old`` folder (its PID follows the prefix; none in older names)."""
    pid = folder.name[len(old_prefix(target)):].split("-")[0]
    return not pid.isdigit() or owner_state(int(pid), {}) == "dead"


def _unlocked_with_files(folder: Path) -> bool:
    try:
        return folder.is_dir() and not (folder / LOCK_FILE).exists() and any(folder.iterdir())
    except OSError:
        return False


def describe(leftovers: Leftovers) -> str:
    """What each leftover is and what to do with it; ``""`` for none."""
    if not leftovers:
        return ""
    target = leftovers.target
    if not os.path.lexists(target):
        return f"output folder '{target}' is missing: {_target_missing(leftovers)}"
    lines = [f"'{folder}' holds an earlier output that a killed run was replacing; '{target}' is complete without "
             f"it: delete it to free the space, or move it elsewhere to keep it"
             for folder in leftovers.replaced]
    lines += [f"'{folder}' holds the finished output of a run killed before it replaced '{target}' (the earlier "
              f"output): to use it, move '{target}' aside and '{folder}' into place; else delete it"
              for folder in leftovers.finished]
    return f"beside output folder '{target}': " + "; ".join(lines)


def _target_missing(leftovers: Leftovers) -> str:
    target = leftovers.target
    kept = [f"'{folder}' (the previous complete output, its only copy)" for folder in leftovers.replaced]
    kept += [f"'{folder}' (the finished new output, not yet put in place)" for folder in leftovers.finished]
    choices = [f"mv '{folder}' '{target}'" for folder in (*leftovers.finished, *leftovers.replaced)]
    return (f"a run killed while putting it in place left {' and '.join(kept)}. Move the one to keep into place "
            f"({' or '.join(choices)}), then delete what is left; layerwise never deletes them")


def warn_about_leftovers(target: Path) -> None:
    """Warn (:class:`OutputLeftoverWarning`) when killed runs left folders beside the output ``target``."""
    if text := describe(find_leftovers(target)):
        warn_user(text, OutputLeftoverWarning)


def missing_output_hint(where: str | os.PathLike) -> str:
    """``; a run killed while putting it in place left ...`` for a missing folder that has leftovers, else ``""``."""
    leftovers = find_leftovers(Path(where).expanduser().absolute())
    return f"; {_target_missing(leftovers)}" if leftovers else ""
