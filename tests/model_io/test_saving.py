import shutil

import pytest

from layerwise.model_io.saving import (
    OWNER_MARK,
    OutputExistsError,
    OutputIsInputError,
    OutputNotWritableError,
    atomic_output_dir,
    check_not_an_input,
    check_output_dir,
)


def test_success_renames_into_place(tmp_path):
    target = tmp_path / "a" / "out"
    with atomic_output_dir(target) as tmp:
        assert tmp.parent == target.parent and tmp.name.startswith(".out.incomplete-")
        (tmp / "f.txt").write_text("x")
        assert not target.exists()
    assert (target / "f.txt").read_text() == "x"
    assert [p.name for p in target.parent.iterdir()] == ["out"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_error_leaves_no_folder(tmp_path, error):
    with pytest.raises(error), atomic_output_dir(tmp_path / "out") as tmp:
        (tmp / "f.txt").write_text("x")
        raise error("stop")
    assert list(tmp_path.iterdir()) == []


def test_error_keeps_the_previous_folder_when_overwriting(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    (target / OWNER_MARK).write_text("{}")  # a layerwise output: overwrite=True may replace it
    with pytest.raises(RuntimeError), atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
        raise RuntimeError
    assert sorted(p.name for p in target.iterdir()) == [OWNER_MARK, "old.txt"]
    with atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_non_empty_folder_is_refused_before_any_work(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "x").write_text("x")
    with pytest.raises(OutputExistsError, match="overwrite=True"), atomic_output_dir(target):
        pytest.fail("must not run")
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputExistsError, match="not a folder"), atomic_output_dir(tmp_path / "file"):
        pass


def test_parents_created_for_a_failed_output_are_removed(tmp_path):
    with pytest.raises(RuntimeError), atomic_output_dir(tmp_path / "a" / "b" / "out") as tmp:
        (tmp / "f.txt").write_text("x")
        raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []


def test_an_output_under_a_file_is_refused_before_any_work(tmp_path):
    (tmp_path / "calib.txt").write_text("x")
    with pytest.raises(OutputNotWritableError, match="calib.txt' is a file, not a folder"):
        check_output_dir(tmp_path / "calib.txt" / "out")


def test_an_unwritable_location_is_refused_naming_it(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("layerwise.model_io.saving.tempfile.mkdtemp", refuse)  # root ignores chmod; a refusal is a refusal
    with pytest.raises(OutputNotWritableError) as info:
        check_output_dir(tmp_path / "new" / "out")
    assert f"'{tmp_path}' is not writable (Permission denied)" in str(info.value)
    assert not (tmp_path / "new").exists()


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _sibling_of(target, owner: int):
    """A temporary folder of ``target`` as a run with PID ``owner`` leaves it."""
    from layerwise.model_io.output_lock import LOCK_FILE

    folder = target.parent / f".{target.name}.incomplete-other"
    folder.mkdir(parents=True)
    (folder / LOCK_FILE).write_text(f"{owner}\n")
    (folder / "model.safetensors").write_text("half written")
    return folder


def test_an_output_another_live_run_writes_is_refused_at_once(tmp_path):
    import os

    from layerwise.model_io.output_lock import OutputLockedError

    target = tmp_path / "out"
    other = _sibling_of(target, os.getpid())  # a live owner that is not this claim
    locked = rf"'{target}' is being written by another run \(process {os.getpid()}"
    with pytest.raises(OutputLockedError, match=locked), atomic_output_dir(target):
        raise AssertionError("the second run must not start writing")
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name] and not target.exists()


def test_a_killed_runs_temporary_folder_is_removed_by_the_next_run(tmp_path):
    target = tmp_path / "out"
    _sibling_of(target, _dead_pid())
    with atomic_output_dir(target) as tmp:
        (tmp / "f.txt").write_text("x")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    assert [p.name for p in target.iterdir()] == ["f.txt"]  # the lock file is not part of the output


def test_the_output_folder_gets_the_users_default_mode(tmp_path):
    import os

    old = os.umask(0o027)
    try:
        with atomic_output_dir(tmp_path / "out") as tmp:
            (tmp / "f.txt").write_text("x")
    finally:
        os.umask(old)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750


@pytest.mark.parametrize(("output", "problem"), [
    ("proj/model", "is the model folder"),
    ("proj", "holds the model folder"),
    ("proj/model/w4a16", "lies inside the model folder"),
    ("proj/data", "holds the dataset file"),
    ("proj/data/calib.txt", "is the dataset file"),
])
def test_an_output_that_would_touch_an_input_is_refused(tmp_path, output, problem):
    (tmp_path / "proj" / "model").mkdir(parents=True)
    (tmp_path / "proj" / "data").mkdir()
    (tmp_path / "proj" / "data" / "calib.txt").write_text("hello")
    inputs = [("model folder", tmp_path / "proj" / "model"), ("dataset file", tmp_path / "proj" / "data" / "calib.txt")]
    with pytest.raises(OutputIsInputError, match=problem):
        check_not_an_input(tmp_path / output, inputs)


def test_outputs_beside_the_inputs_are_fine(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "calib.txt").write_text("hello")
    inputs = [("model folder", tmp_path / "model"), ("dataset file", tmp_path / "calib.txt")]
    for output in ("model-w4a16", "out/model", "modelx"):
        check_not_an_input(tmp_path / output, inputs)


def test_a_symlink_to_the_model_folder_is_the_model_folder(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "model")
    with pytest.raises(OutputIsInputError, match="is the model folder"):
        check_not_an_input(tmp_path / "link", [("model folder", tmp_path / "model")])


def test_overwrite_true_replaces_only_a_folder_layerwise_wrote(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not written by layerwise.*'notes.txt'.*--overwrite-any"):
        check_output_dir(target, overwrite=True)
    assert check_output_dir(target, overwrite="any") == target
    (target / OWNER_MARK).write_text("{}")
    assert check_output_dir(target, overwrite=True) == target


def test_an_unknown_overwrite_value_is_refused(tmp_path):
    with pytest.raises(ValueError, match="overwrite='yes'"):
        check_output_dir(tmp_path / "out", overwrite="yes")


def test_every_saved_file_and_folder_gets_the_umask_s_mode(tmp_path):
    import os
    import tempfile

    old = os.umask(0o022)
    try:
        with atomic_output_dir(tmp_path / "out") as tmp:
            handle, name = tempfile.mkstemp(dir=tmp)  # 0600, as writers that rename into place make them
            os.close(handle)
            os.rename(name, tmp / "model.safetensors")
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "f.txt").write_text("x")
            os.chmod(tmp / "sub" / "f.txt", 0o600)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [tmp_path / "out", *(tmp_path / "out").rglob("*")]}
    assert modes == {"out": 0o755, "model.safetensors": 0o644, "sub": 0o755, "f.txt": 0o644}


def _finished_output_while_a_folder_appears(target, overwrite=False):
    """Write a finished output while a user creates a non-empty folder at ``target``."""
    with atomic_output_dir(target, overwrite=overwrite) as tmp:
        (tmp / "model.safetensors").write_text("hours of calibration")
        (tmp / OWNER_MARK).write_text("{}")
        target.mkdir()
        (target / "notes.txt").write_text("mine")


def test_a_folder_appearing_at_the_output_while_the_run_works_keeps_the_finished_output_aside(tmp_path):
    from layerwise.model_io.output_lock import claim
    from layerwise.model_io.saving import OutputKeptAsideError

    target = tmp_path / "out"
    with pytest.raises(OutputKeptAsideError, match=r"/out' appeared or filled while the run worked .*notes\.txt"
                                                    r".*kept, complete, in .*out\.complete-.*mv ") as caught:
        _finished_output_while_a_folder_appears(target)
    kept = caught.value.kept
    assert kept.parent == tmp_path and kept.name.startswith("out.complete-")
    assert (kept / "model.safetensors").read_text() == "hours of calibration"
    assert [p.name for p in target.iterdir()] == ["notes.txt"]  # the user's folder is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", kept.name])
    # a later run's clean-up of stale temporary folders never touches it
    claim(tmp_path / "out")
    assert (kept / "model.safetensors").is_file()


def test_a_finished_output_kept_aside_gets_a_name_of_its_own(tmp_path):
    from layerwise.model_io.saving import OutputKeptAsideError

    kept = []
    for _ in range(2):
        target = tmp_path / "out"
        with pytest.raises(OutputKeptAsideError) as caught:
            _finished_output_while_a_folder_appears(target, overwrite=True)  # the folder is not layerwise's
        kept.append(caught.value.kept)
        shutil.rmtree(target)
    assert len(set(kept)) == 2 and all((k / "model.safetensors").is_file() for k in kept)


def test_overwrite_through_a_symlink_writes_where_it_points_and_leaves_nothing_behind(tmp_path):
    real = tmp_path / "disk" / "real_out"
    real.mkdir(parents=True)
    (real / OWNER_MARK).write_text("{}")
    (real / "old.txt").write_text("old")
    link = tmp_path / "outlink"
    link.symlink_to(real, target_is_directory=True)
    with atomic_output_dir(link, overwrite=True) as tmp:
        assert tmp.parent == real.parent  # beside what the link points to: the rename stays on that disk
        (tmp / "new.txt").write_text("new")
    assert link.is_symlink() and link.resolve() == real
    assert sorted(p.name for p in real.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["disk", "outlink"]
    assert sorted(p.name for p in real.parent.iterdir()) == ["real_out"]


def test_a_dangling_symlink_is_written_where_it_points(tmp_path):
    link = tmp_path / "outlink"
    link.symlink_to(tmp_path / "later", target_is_directory=True)
    with atomic_output_dir(link) as tmp:
        (tmp / "f.txt").write_text("x")
    assert link.is_symlink() and (link / "f.txt").read_text() == "x"


# -- a write the operating system refuses: a named error, never "unexpected OSError ... report it" ---------
def test_a_full_disk_while_writing_names_the_folder_the_reason_and_the_fix(tmp_path):
    import errno

    target = tmp_path / "out"
    with pytest.raises(OutputNotWritableError) as info, atomic_output_dir(target) as tmp:
        (tmp / "config.json").write_text("{}")
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp / "model.safetensors"))
    message = str(info.value)
    assert f"'{target}'" in message and "the disk is full (No space left on device)" in message
    assert "free space" in message and isinstance(info.value.__cause__, OSError)
    assert list(tmp_path.iterdir()) == []  # written whole or not at all


def test_a_file_size_limit_while_saving_is_a_named_error_with_nothing_left(tiny_llama_dir, tmp_path):
    """``ulimit -f``: safetensors reports EFBIG as a SafetensorError, not an OSError."""
    import resource

    import layerwise

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))  # Python ignores SIGXFSZ: writes fail, EFBIG
    try:
        with pytest.raises(OutputNotWritableError) as info:
            layerwise.compress(tiny_llama_dir, "W8A16", output_dir=tmp_path / "out", show_progress=False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert "a file grew past the largest size" in str(info.value) and "ulimit -f unlimited" in str(info.value)
    assert type(info.value.__cause__).__name__ == "SafetensorError"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]


def test_an_os_error_about_a_file_elsewhere_is_not_called_an_output_failure(tmp_path):
    import errno

    with pytest.raises(PermissionError) as info, atomic_output_dir(tmp_path / "out"):
        raise PermissionError(errno.EACCES, "Permission denied", "/elsewhere/model.safetensors")
    assert not isinstance(info.value, OutputNotWritableError)


def test_a_checkpoint_that_cannot_be_unlocked_leaves_the_runs_own_error(tmp_path, caplog):
    """Marking a kept checkpoint free can fail too (a full disk); the user must still see why the run stopped."""
    from layerwise.model_io.output_lock import LOCK_FILE
    from layerwise.model_io.resume import STATE_FILE, STATE_FOLDER
    from layerwise.model_io.saving import reserve_output

    with pytest.raises(RuntimeError, match="the run's own error"), reserve_output(tmp_path / "out") as tmp:
        (tmp / STATE_FOLDER).mkdir()
        (tmp / STATE_FOLDER / STATE_FILE).write_bytes(b"checkpoint")
        (tmp / LOCK_FILE).unlink()
        (tmp / LOCK_FILE).mkdir()  # the lock cannot be rewritten
        raise RuntimeError("the run's own error")
    assert (tmp / STATE_FOLDER / STATE_FILE).is_file()  # the checkpoint is kept all the same
    assert "could not mark the checkpoint" in caplog.text and "is kept in" in caplog.text


def test_a_temporary_folder_written_from_another_machine_is_never_removed(tmp_path):
    from layerwise.common.processes import process_identity
    from layerwise.model_io.output_lock import LOCK_FILE, OutputLockedError

    target = tmp_path / "out"
    other = _sibling_of(target, _dead_pid())  # dead here, but the PID is another machine's
    identity = {**process_identity(), "host": "gpu-node-7"}
    (other / LOCK_FILE).write_text(f"{_dead_pid()}\n" + "".join(f"{k}={v}\n" for k, v in identity.items()))
    with pytest.raises(OutputLockedError, match=r"on 'gpu-node-7' \(another machine or container.*"
                                                r"If that run is over, delete"), atomic_output_dir(target):
        raise AssertionError("the second run must not start writing")
    assert (other / "model.safetensors").read_text() == "half written"  # the other run's work is kept


def test_a_lock_names_its_process_and_where_it_runs(tmp_path):
    import os

    from layerwise.common.processes import process_identity
    from layerwise.model_io.output_lock import LOCK_FILE, lock_owner

    with atomic_output_dir(tmp_path / "out") as tmp:
        assert lock_owner(tmp) == os.getpid()
        lines = (tmp / LOCK_FILE).read_text().splitlines()
        assert dict(line.split("=", 1) for line in lines[1:]) == process_identity()


def test_a_full_disk_under_the_activation_cache_is_named_and_leaves_no_output(tiny_llama_dir, tmp_path, monkeypatch):
    """The cache's own error reaches the user (not taken for the output's), and the output never appears."""
    import errno

    import layerwise
    from layerwise.errors import DiskFullError

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("torch.save", disk_full)
    with pytest.raises(DiskFullError, match="disk cache of activations .* TMPDIR"):
        layerwise.compress(tiny_llama_dir, "GPTQ_W8A16", dataset=["a b c d e f"] * 2, output_dir=tmp_path / "out",
                           show_progress=False, options=layerwise.CompressOptions.of(offload="disk"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-llama"]
