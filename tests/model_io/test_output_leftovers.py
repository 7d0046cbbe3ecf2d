"""A run killed between its last renames: the folders it leaves are named, with what to do, and never deleted."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from layerwise.errors import ModelLoadError
from layerwise.model_io.model_paths import check_model_path
from layerwise.model_io.output_leftovers import OutputLeftoverWarning
from layerwise.model_io.saving import atomic_output_dir, reserve_output

# replaces `out` (which holds `previous`) by a folder holding `new`, killed by SIGKILL between the two renames
KILLED_BETWEEN_RENAMES = """
import os, signal, sys
from pathlib import Path
from layerwise.model_io import saving
out, real_rename = Path(sys.argv[1]), os.rename
def rename(source, destination):
    real_rename(source, destination)
    if Path(source) == out:  # the previous output moved aside, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)
saving.os.rename = rename
with saving.atomic_output_dir(out, overwrite="any") as tmp:
    (tmp / "new").write_text("the new output")
"""


def _killed_while_replacing(tmp_path: Path) -> Path:
    out = tmp_path / "out"
    with atomic_output_dir(out) as tmp:
        (tmp / "previous").write_text("the previous output")
    done = subprocess.run([sys.executable, "-c", KILLED_BETWEEN_RENAMES, str(out)], capture_output=True, text=True,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    return out


def _only(out: Path, kind: str) -> Path:
    (found,) = out.parent.glob(f".{out.name}.{kind}-*")
    return found


def test_a_run_killed_between_its_renames_is_named_to_the_next_run_and_nothing_is_deleted(tmp_path):
    out = _killed_while_replacing(tmp_path)
    assert not out.exists()
    old, new = _only(out, "old"), _only(out, "incomplete")
    assert (old / "previous").is_file() and (new / "new").is_file()
    with pytest.warns(OutputLeftoverWarning) as caught, reserve_output(out):
        pass
    message = str(caught[0].message)
    assert f"output folder '{out}' is missing: a run killed while putting it in place left '{old}' (the previous " \
           f"complete output, its only copy) and '{new}' (the finished new output" in message
    assert f"mv '{new}' '{out}' or mv '{old}' '{out}'" in message and "layerwise never deletes them" in message
    assert (old / "previous").is_file() and (new / "new").is_file()  # the next run's claim removed neither


def test_reading_the_missing_output_names_the_folder_to_move_into_place(tmp_path):
    out = _killed_while_replacing(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        check_model_path(out)
    message = str(info.value)
    assert f"model folder '{out}' does not exist; a run killed while putting it in place left" in message
    assert f"mv '{_only(out, 'incomplete')}' '{out}'" in message


def test_a_replaced_folder_left_beside_a_complete_output_is_named_with_its_fix(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    dead = tmp_path / ".out.old-999999999-ab12"  # no process has that PID: its run is over
    dead.mkdir()
    with pytest.warns(OutputLeftoverWarning, match="/out' is complete without it: delete it to free the space"), \
            reserve_output(out, overwrite="any"):
        pass
    assert dead.is_dir()


def test_a_replaced_folder_a_live_run_is_deleting_is_no_leftover(tmp_path, recwarn):
    import os

    (tmp_path / "out").mkdir()
    (tmp_path / f".out.old-{os.getpid()}-ab12").mkdir()
    with reserve_output(tmp_path / "out", overwrite="any"):
        pass
    assert not [w for w in recwarn if issubclass(w.category, OutputLeftoverWarning)]
