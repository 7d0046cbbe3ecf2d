import pytest

from layerwise.saving import OutputExistsError, atomic_output_dir


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
    with pytest.raises(RuntimeError), atomic_output_dir(target, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
        raise RuntimeError
    assert [p.name for p in target.iterdir()] == ["old.txt"]
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
