"""resume=True: a run SIGKILLed after piece k continues from its checkpoint and ends as an uninterrupted run."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import layerwise
from layerwise.errors import InvalidArgumentError
from layerwise.host.lifecycle import Lifecycle
from layerwise.model_io.resume import ResumeError
from tests.model_io.streaming.test_streamed_compress import _samples, _save, _saved

KILLED_AFTER = 4  # pieces finished (and checkpointed) before the kill

# the interrupted run: the same call, killed by SIGKILL right after its 4th checkpoint was saved
KILLED_RUN = """
import os, signal, sys, torch
import layerwise
from layerwise.model_io.resume import PieceCheckpoint
source, out, recipe, samples = sys.argv[1], sys.argv[2], sys.argv[3], torch.load(sys.argv[4])
original = PieceCheckpoint.save
def save_then_die(self, finished, *args, **kwargs):
    original(self, finished, *args, **kwargs)
    if finished + 1 == {killed}:
        os.kill(os.getpid(), signal.SIGKILL)
PieceCheckpoint.save = save_then_die
layerwise.compress(source, recipe, dataset=samples, output_dir=out, show_progress=False,
                   options=layerwise.CompressOptions.of(weights="stream"))
""".replace("{killed}", str(KILLED_AFTER))


def _kill_midway(tmp_path: Path, source: Path, out: Path, recipe: str) -> Path:
    samples_file = tmp_path / "samples.pt"
    torch.save(_samples(), samples_file)
    done = subprocess.run([sys.executable, "-c", KILLED_RUN, str(source), str(out), recipe, str(samples_file)],
                          capture_output=True, text=True, cwd=Path(__file__).parents[3])
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert not out.exists()
    (left,) = list(out.parent.glob(f".{out.name}.incomplete-*"))
    progress = json.loads((left / ".layerwise-resume" / "progress.json").read_text())
    assert progress["finished"] == KILLED_AFTER - 1
    return left


#: runs that carry the uncompressed model's stream beside the compressed one: the checkpoint holds it too
GPTAQ = "GPTQModifier:\n  scheme: W4A16\n  group_size: 32\n  gptaq: true\n"
AUTOROUND = "AutoRoundModifier:\n  scheme: W4A16\n  group_size: 32\n  iters: 2\n  batch_size: 2\n"


@pytest.mark.filterwarnings("ignore:4 calibration samples")
@pytest.mark.parametrize("recipe", ["GPTQ_W4A16", "SQ_GPTQ_W8A8", GPTAQ, AUTOROUND])
def test_a_killed_run_resumes_after_its_last_piece_and_equals_an_uninterrupted_one(tmp_path, monkeypatch, recipe):
    source = _save(tmp_path / "model")
    reference = tmp_path / "reference"
    layerwise.compress(str(source), recipe, dataset=_samples(), output_dir=reference, show_progress=False, options=layerwise.CompressOptions.of(weights="stream"), device="cpu")
    out = tmp_path / "out"
    left = _kill_midway(tmp_path, source, out, recipe)

    epochs: list[list[str]] = []
    original = Lifecycle.sequential_epoch_end
    monkeypatch.setattr(Lifecycle, "sequential_epoch_end", lambda self, modules: (epochs.append(modules),
                                                                                  original(self, modules))[1])
    model = layerwise.compress(str(source), recipe, dataset=_samples(), output_dir=out, show_progress=False,
                               options=layerwise.CompressOptions.of(resume=True), device="cpu")
    total = int(model.layerwise_report.pieces.split(":")[1].split()[0])  # "layers: 13 pieces ..."
    assert len(epochs) == total - KILLED_AFTER  # the finished pieces did not run again
    # the report is the whole run's: resumed where, the full output's size, the interrupted run's time too
    report, uninterrupted = model.layerwise_report, json.loads((reference / "layerwise_summary.json").read_text())
    assert report.resumed_from_piece == KILLED_AFTER + 1
    assert report.bytes_after == uninterrupted["bytes_after"]
    # the subgraph cut of a 3-layer model has 4 pieces: that run was killed after its last one
    assert report.resumed_after_last_piece == (total == KILLED_AFTER)
    where = "after the last piece" if total == KILLED_AFTER else f"from piece {KILLED_AFTER + 1}"
    assert f"resumed:            {where}" in str(report)
    assert report.accounting["before the resume"]["seconds"] > 0  # the interrupted run's time, named
    assert sum(work["seconds"] for work in report.accounting.values()) <= report.seconds
    assert json.loads((out / "layerwise_summary.json").read_text())["resumed_from_piece"] == KILLED_AFTER + 1
    expected, got = _saved(reference), _saved(out)
    assert sorted(expected) == sorted(got)
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert json.loads((out / "config.json").read_text()) == json.loads((reference / "config.json").read_text())
    assert not left.exists() and not (out / ".layerwise-resume").exists()


def test_a_checkpoint_is_reported_not_reused_or_deleted_without_resume(tmp_path):
    source = _save(tmp_path / "model")
    out = tmp_path / "out"
    left = _kill_midway(tmp_path, source, out, "GPTQ_W4A16")
    with pytest.raises(ResumeError, match=r"left a checkpoint in .*after piece 4 of .*--resume"):
        layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=out, show_progress=False, device="cpu")
    assert left.exists()
    # a different recipe (or data, model, options, versions) cannot continue it: what changed is named
    with pytest.raises(ResumeError, match="recipe differs"):
        layerwise.compress(str(source), "GPTQ_W8A16", dataset=_samples(), output_dir=out, show_progress=False, options=layerwise.CompressOptions.of(resume=True), device="cpu")
    with pytest.raises(ResumeError, match="dataset differs"):
        layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(5), output_dir=out, show_progress=False, options=layerwise.CompressOptions.of(resume=True), device="cpu")
    assert left.exists() and not out.exists()


def test_resume_without_a_checkpoint_says_so_and_runs_from_the_start(tmp_path):
    from layerwise.model_io.resume import ResumeWarning

    source = _save(tmp_path / "model")
    with pytest.warns(ResumeWarning, match="no interrupted run of this output left a checkpoint"):
        model = layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=tmp_path / "out",
                                   show_progress=False, options=layerwise.CompressOptions.of(resume=True), device="cpu")
    assert model.layerwise_report.resumed_from_piece is None
    assert model.layerwise_report.weights.startswith("stream")
    assert (tmp_path / "out" / "config.json").is_file()


def test_resume_needs_a_folder_and_an_output(tmp_path):
    source = _save(tmp_path / "model")
    with pytest.raises(InvalidArgumentError, match="pass output_dir"):
        layerwise.compress(str(source), "W4A16", options=layerwise.CompressOptions.of(resume=True), device="cpu")
    with pytest.raises(InvalidArgumentError, match="weights streamed"):
        layerwise.compress(str(source), "W4A16", output_dir=tmp_path / "o", options=layerwise.CompressOptions.of(resume=True, weights="memory"), device="cpu")


def _interrupt_the_merge(monkeypatch, source: Path, out: Path) -> Path:
    """A run whose final shard merge fails (a full disk) after its first file; returns the folder it keeps."""
    from layerwise.model_io.streaming.shards import ShardWriter

    merge, unlink = ShardWriter.finish, Path.unlink

    def merge_until_the_disk_fills(self, *args, **kwargs):
        def unlink_then_fail(path, *a, **k):
            unlink(path, *a, **k)
            raise OSError(28, "No space left on device")

        with monkeypatch.context() as patched:
            patched.setattr(Path, "unlink", unlink_then_fail)
            return merge(self, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(ShardWriter, "finish", merge_until_the_disk_fills)
        with pytest.raises(OSError, match="No space left"):
            layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=out, show_progress=False,
                               options=layerwise.CompressOptions.of(weights="stream"), device="cpu")
    (left,) = list(out.parent.glob(f".{out.name}.incomplete-*"))
    return left


@pytest.mark.filterwarnings("ignore:4 calibration samples")
@pytest.mark.parametrize("shard_bytes", [5 * 2**30, 100_000])  # one shard; several (single-part ones too)
def test_a_run_interrupted_during_its_final_merge_resumes_and_equals_an_uninterrupted_one(tmp_path, monkeypatch,
                                                                                         shard_bytes):
    from layerwise.model_io.streaming.shards import ShardWriter

    monkeypatch.setattr(ShardWriter.finish, "__defaults__", (shard_bytes,))
    source = _save(tmp_path / "model")
    reference = tmp_path / "reference"
    layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=reference, show_progress=False,
                       options=layerwise.CompressOptions.of(weights="stream"), device="cpu")
    out = tmp_path / "out"
    left = _interrupt_the_merge(monkeypatch, source, out)
    model = layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=out, show_progress=False,
                               options=layerwise.CompressOptions.of(resume=True), device="cpu")
    assert "resumed:            after the last piece" in str(model.layerwise_report)
    expected, got = _saved(reference), _saved(out)
    assert sorted(expected) == sorted(got)
    assert [k for k in expected if not torch.equal(expected[k], got[k])] == []
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    assert shard_bytes > 2**20 or len(list(out.glob("model-*.safetensors"))) > 2
    assert not left.exists()


@pytest.mark.filterwarnings("ignore:4 calibration samples")
def test_a_checkpoint_whose_parts_are_gone_is_refused_naming_the_folder_to_delete(tmp_path):
    source = _save(tmp_path / "model")
    out = tmp_path / "out"
    left = _kill_midway(tmp_path, source, out, "GPTQ_W4A16")
    (left / "part-00000.safetensors").unlink()
    with pytest.raises(ResumeError, match=rf"cannot be continued: 1 of the part files .*part-00000.*Delete '{left}'"):
        layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=out, show_progress=False,
                           options=layerwise.CompressOptions.of(resume=True), device="cpu")
