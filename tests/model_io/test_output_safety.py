"""No output ever destroys an input: each case of careless use through the real CLI.

Every test snapshots every byte under the user's project folder, runs ``layerwise compress``
as a user would, and checks the exit code, the message and that no byte changed.
"""

import shutil
from pathlib import Path

import pytest

from layerwise.cli import main


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def project(tiny_llama_dir, tmp_path):
    """``proj/model`` (a model folder), ``proj/notes.txt``, ``proj/data/calib.txt``, ``proj/recipes/w4.yaml``."""
    proj = tmp_path / "proj"
    shutil.copytree(tiny_llama_dir, proj / "model")
    (proj / "notes.txt").write_text("unrelated notes\n")
    (proj / "data").mkdir()
    (proj / "data" / "calib.txt").write_text("the cat sat on the mat\n" * 8)
    (proj / "recipes").mkdir()
    (proj / "recipes" / "w4.yaml").write_text("QuantizationModifier:\n  scheme: W8A16\n")
    return proj


def compress(capsys, *args: str) -> tuple[int, str]:
    code = main(["compress", "--recipe", "W8A16", "--quiet", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--overwrite", "--overwrite-any"])
@pytest.mark.parametrize(("model", "output", "cwd", "problem"), [
    ("model", "model", "proj", "is the model folder"),
    ("proj/model", "proj", "", "holds the model folder"),
    ("model", ".", "proj", "holds the model folder"),
    ("model", "model/w4a16", "proj", "lies inside the model folder"),
    ("proj/model", "proj/model/", "", "is the model folder"),
])
def test_an_output_over_the_model_is_refused_and_nothing_changes(project, capsys, monkeypatch, flag, model, output,
                                                                  cwd, problem):
    monkeypatch.chdir(project if cwd == "proj" else project.parent)
    before = snapshot(project)
    code, err = compress(capsys, "--model", model, "--output-dir", output, flag)
    assert code == 2 and problem in err and "Choose an output_dir outside it" in err
    assert snapshot(project) == before
    assert sorted(p.name for p in project.iterdir()) == ["data", "model", "notes.txt", "recipes"]


@pytest.mark.parametrize(("option", "value", "output", "problem"), [
    ("--dataset", "data/calib.txt", "data", "holds the dataset file"),
    ("--recipe", "recipes/w4.yaml", "recipes", "holds the recipe file"),
])
def test_an_output_over_the_dataset_or_recipe_file_is_refused(project, capsys, monkeypatch, option, value, output,
                                                              problem):
    monkeypatch.chdir(project)
    before = snapshot(project)
    code, err = compress(capsys, "--model", "model", option, value, "--output-dir", output, "--overwrite-any")
    assert code == 2 and problem in err
    assert snapshot(project) == before


def test_overwrite_replaces_a_layerwise_output_but_not_a_users_folder(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    mine = project / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    code, err = compress(capsys, "--model", "model", "--output-dir", "mine", "--overwrite")
    assert code == 2 and "was not written by layerwise" in err and "'thesis.tex'" in err and "--overwrite-any" in err
    assert (mine / "thesis.tex").read_text() == "years of work"

    assert compress(capsys, "--model", "model", "--output-dir", "out")[0] == 0
    (project / "out" / "stale.txt").write_text("from the first run")
    assert compress(capsys, "--model", "model", "--output-dir", "out", "--overwrite")[0] == 0
    assert not (project / "out" / "stale.txt").exists() and (project / "out" / "layerwise_summary.json").is_file()


def test_overwrite_any_replaces_a_folder_that_is_no_input(project, capsys, monkeypatch):
    monkeypatch.chdir(project)
    (project / "scratch").mkdir()
    (project / "scratch" / "old.bin").write_bytes(b"\x00")
    assert compress(capsys, "--model", "model", "--output-dir", "scratch", "--overwrite-any")[0] == 0
    assert not (project / "scratch" / "old.bin").exists() and (project / "scratch" / "config.json").is_file()


def test_a_loaded_models_source_folder_is_protected_in_python(project):
    import layerwise
    from layerwise.model_io.loading import load_model
    from layerwise.model_io.saving import OutputIsInputError

    model = load_model(project / "model")
    before = snapshot(project)
    with pytest.raises(OutputIsInputError, match="is the model's source folder"):
        layerwise.compress(model, "W4A16", output_dir=project / "model", overwrite="any", show_progress=False)
    assert snapshot(project) == before


@pytest.fixture
def hub_cache(tiny_llama_dir, tmp_path):
    """A Hugging Face cache's layout: ``snapshots/main`` holds links to the files in ``blobs``."""
    repo = tmp_path / "cache" / "models--tiny"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "main").mkdir(parents=True)
    for file in Path(tiny_llama_dir).iterdir():
        shutil.copy(file, repo / "blobs" / f"hash-{file.name}")
        (repo / "snapshots" / "main" / file.name).symlink_to(Path("..", "..", "blobs", f"hash-{file.name}"))
    return repo


@pytest.mark.parametrize("mode", [[], ["--model-free"]])
def test_an_output_over_the_blobs_a_cached_snapshot_links_to_is_refused(hub_cache, capsys, mode):
    before = snapshot(hub_cache / "blobs")
    code, err = compress(capsys, "--model", str(hub_cache / "snapshots" / "main"),
                         "--output-dir", str(hub_cache / "blobs"), "--overwrite-any", *mode)
    assert code == 2 and "links to" in err and "Choose an output_dir outside it" in err, err
    assert snapshot(hub_cache / "blobs") == before
    assert (hub_cache / "snapshots" / "main" / "config.json").is_file()  # the links still lead somewhere


def test_an_output_beside_the_cache_is_fine(hub_cache, capsys, tmp_path):
    assert compress(capsys, "--model", str(hub_cache / "snapshots" / "main"), "--output-dir",
                    str(tmp_path / "out"))[0] == 0


def test_an_eval_file_inside_the_output_folder_is_refused_before_any_work(project, capsys, monkeypatch):
    """--eval's held-out text is an input too: --overwrite replaced the folder holding it, then the eval failed."""
    monkeypatch.chdir(project)
    assert compress(capsys, "--model", "model", "--output-dir", "out")[0] == 0
    (project / "out" / "heldout.txt").write_text("held-out text\n" * 40)
    before = snapshot(project)
    code, err = compress(capsys, "--model", "model", "--output-dir", "out", "--overwrite", "--eval", "out/heldout.txt")
    assert code == 2 and "holds the evaluation file 'out/heldout.txt'" in err
    assert snapshot(project) == before


@pytest.mark.parametrize("weights", ["memory", "stream"])
def test_a_folder_made_at_the_output_during_the_run_keeps_the_finished_model_aside(project, capsys, monkeypatch,
                                                                                   weights):
    from layerwise.model_io import saving

    monkeypatch.chdir(project)
    finish = saving.give_default_modes

    def user_makes_the_folder(folder):  # the last moment before the finished folder is put in place
        (project / "late").mkdir()
        (project / "late" / "notes.txt").write_text("mine")
        finish(folder)

    monkeypatch.setattr(saving, "give_default_modes", user_makes_the_folder)
    code, err = compress(capsys, "--model", "model", "--output-dir", "late", "--weights", weights)
    (kept,) = project.glob("late.complete-*")
    assert code != 0 and "the finished output is kept, complete, in" in err and kept.name in err
    assert (kept / "layerwise_summary.json").is_file() and (kept / "config.json").is_file()
    assert not (kept / ".layerwise-resume").exists() and not (kept / ".layerwise.lock").exists()
    assert [p.name for p in (project / "late").iterdir()] == ["notes.txt"]
    assert list(project.glob(".late.*")) == []


def test_overwrite_through_a_symlinked_output_keeps_the_link(project, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(project)
    assert compress(capsys, "--model", "model", "--output-dir", str(tmp_path / "real_out"))[0] == 0
    Path("outlink").symlink_to(tmp_path / "real_out", target_is_directory=True)
    assert compress(capsys, "--model", "model", "--output-dir", "outlink", "--overwrite")[0] == 0
    assert Path("outlink").is_symlink() and (tmp_path / "real_out" / "config.json").is_file()
    assert [p.name for p in project.iterdir() if "outlink" in p.name] == ["outlink"]
    assert [p.name for p in tmp_path.iterdir() if "real_out" in p.name] == ["real_out"]
