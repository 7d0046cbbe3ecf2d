"""layerwise.testing.check_saver: the built-in saver passes it, and broken savers are caught by name."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from layerwise import hookimpl
from layerwise.host.plugin_manager import registry
from layerwise.plugins.savers.compressed_tensors import save_compressed
from layerwise.testing import PluginCheckError
from layerwise.testing.savers import check_saver


@pytest.mark.parametrize("name", [name for name, _ in registry("savers").items()])
def test_every_registered_saver_passes_the_kit(name):
    check_saver(name)


def write_over(model, output_dir, tokenizer=None, recipe=None, extra_files=None, overwrite=False):
    """Writes straight into the folder, whatever is there."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "weights.txt").write_text("w")
    for relative, content in (extra_files or {}).items():
        (folder / relative).parent.mkdir(parents=True, exist_ok=True)
        (folder / relative).write_text(content) if isinstance(content, str) else (folder / relative).write_bytes(
            content)


def leave_half(model, output_dir, tokenizer=None, recipe=None, extra_files=None, overwrite=False):
    """Refuses and replaces correctly, but a failure midway leaves a half-written folder."""
    folder = Path(output_dir)
    if folder.exists() and any(folder.iterdir()):
        if not overwrite:
            raise FileExistsError(folder)
        shutil.rmtree(folder)
    write_over(model, folder, extra_files=extra_files)


def forget_extras(model, output_dir, tokenizer=None, recipe=None, extra_files=None, overwrite=False):
    """A correct compressed-tensors folder without the run summary and modifiers' files."""
    save_compressed(model, output_dir, overwrite=overwrite)


class BrokenSavers:
    @hookimpl
    def layerwise_register_savers(self, register):
        for saver in (write_over, leave_half, forget_extras):
            register(f"kit-{saver.__name__}", saver)


@pytest.fixture
def broken(register_plugin):
    register_plugin(BrokenSavers(), "kit-broken-savers")


@pytest.mark.parametrize("saver,message", [
    (forget_extras, r"check_saver\(kit-forget_extras\): writes: extra files missing or changed: \['layerwise_summary.json', 'kit/notes.txt'"),
    (write_over, r"check_saver\(kit-write_over\): refuses: an existing non-empty folder was written over"),
    (leave_half, r"check_saver\(kit-leave_half\): all or nothing: a save that failed midway left .* behind"),
])
def test_a_broken_saver_is_caught_naming_the_step(broken, saver, message):
    with pytest.raises(PluginCheckError, match=message):
        check_saver(saver)
