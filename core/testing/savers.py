"""``check_saver``: what ``compress(..., output_dir=...)`` assumes of every output format.

A saver (:class:`layerwise.plugin.saving.Saver`, or a function registered and wrapped in one) is
called as ``saver.save(model, output_dir, tokenizer=, recipe=, extra_files=, overwrite=)`` on a
model layerwise compressed (here: a seeded tiny Llama, W4A16 round to nearest). Checked:

1. **registered**: the callable is in the savers registry (``compress(save_format=...)`` names it);
2. **writes**: the folder appears, with every extra file (the run summary, modifiers' files) at its
   relative path and content (the run summary marks it as a layerwise output);
3. **refuses**: an existing non-empty folder without ``overwrite`` raises and is left untouched;
4. **overwrites**: with ``overwrite=True`` the old content is gone and the new one is there;
5. **all or nothing**: a failure while writing (an extra file that cannot be written) raises and
   leaves no folder behind;
6. **sizes**: ``saved_bytes(model)`` is a positive number of bytes (the report's size after).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .errors import PluginCheckError
from .modifiers import tiny_llama

CHECK = "check_saver"
#: what ``compress`` passes: the run summary (it marks the folder as one ``overwrite=True`` may replace) and more
EXTRA = {"layerwise_summary.json": "{}\n", "kit/notes.txt": "written by layerwise.testing.check_saver\n",
         "kit/blob.bin": b"\x00\x01layerwise"}


def check_saver(saver: Callable[..., Any] | str, *,
                model_factory: Callable[[], torch.nn.Module] = tiny_llama) -> None:
    """Run every check on ``saver`` (the callable or its registered name); raises :class:`PluginCheckError`."""
    import layerwise

    name, save = _registered(saver)
    model = model_factory()
    from layerwise.host.plugin_manager import registry

    quantize = registry("modifiers").get("QuantizationModifier")(scheme="W4A16", strategy="channel")
    layerwise.compress(model, quantize, show_progress=False)
    with tempfile.TemporaryDirectory(prefix="layerwise-check-saver-") as root:
        folder = Path(root) / "out"
        _call(name, "writes", save, model, folder, extra_files=EXTRA)
        missing = [rel for rel, content in EXTRA.items() if not _holds(folder / rel, content)]
        if missing:
            raise _fail(name, "writes", f"extra files missing or changed: {missing}",
                        "write every extra_files entry at its relative path inside the folder")
        _check_refuses(name, save, model, folder)
        _call(name, "overwrites", save, model, folder, overwrite=True)
        if (folder / "kit").exists():
            raise _fail(name, "overwrites", "overwrite=True kept files of the previous folder",
                        "replace the whole folder (write a new one, then swap it in)")
        _check_all_or_nothing(name, save, model, Path(root) / "broken")
    size = save.saved_bytes(model)
    if not isinstance(size, int) or size <= 0:
        raise _fail(name, "sizes", f"saved_bytes(model) returned {size!r}",
                    "return the bytes the model's tensors take in this format (an int > 0)")


def _fail(name: str, step: str, problem: str, fix: str = "") -> PluginCheckError:
    return PluginCheckError(CHECK, name, step, problem, fix)


def _registered(saver: Callable[..., Any] | str) -> tuple[str, Callable[..., Any]]:
    from layerwise.host.plugin_manager import registry

    found = dict(registry("savers").items())
    if isinstance(saver, str):
        if saver not in found:
            raise _fail(saver, "registered", f"no saver of that name; registered: {sorted(found)}")
        return saver, found[saver]
    names = [n for n, obj in found.items() if obj is saver or getattr(obj, "function", None) is saver]
    if not names:
        raise _fail(getattr(saver, "__name__", repr(saver)), "registered", "the callable is not in the savers "
                    "registry, so compress(save_format=...) cannot name it",
                    "register it from a layerwise_register_savers hookimpl")
    return names[0], saver


def _call(name: str, step: str, save: Callable[..., Any], model: torch.nn.Module, folder: Path,
          **kwargs: Any) -> None:
    try:
        save(model, folder, tokenizer=None, recipe="QuantizationModifier:\n  scheme: W4A16\n", **kwargs)
    except Exception as error:
        raise _fail(name, step, f"saving raised {type(error).__name__}: {error}",
                    "accept (model, output_dir, tokenizer=, recipe=, extra_files=, overwrite=)") from error
    if not folder.is_dir() or not any(folder.iterdir()):
        raise _fail(name, step, f"no folder written at {folder}")


def _holds(path: Path, content: str | bytes) -> bool:
    if not path.is_file():
        return False
    return path.read_bytes() == (content.encode() if isinstance(content, str) else content)


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _check_refuses(name: str, save: Callable[..., Any], model: torch.nn.Module, folder: Path) -> None:
    before = _snapshot(folder)
    try:
        save(model, folder, tokenizer=None, recipe=None, extra_files={"kit/other.txt": "x"})
    except Exception:  # noqa: BLE001, S110 - refusing is the point; what matters is the folder
        pass
    else:
        raise _fail(name, "refuses", "an existing non-empty folder was written over without overwrite=True",
                    "refuse it (layerwise.model_io.saving.check_output_dir) unless overwrite is set")
    if _snapshot(folder) != before:
        raise _fail(name, "refuses", "the refused save changed the existing folder", "check before writing")


def _check_all_or_nothing(name: str, save: Callable[..., Any], model: torch.nn.Module, folder: Path) -> None:
    unwritable: Any = object()  # neither str nor bytes: writing it fails midway
    try:
        save(model, folder, tokenizer=None, recipe=None, extra_files={"kit/ok.txt": "x", "kit/bad.txt": unwritable})
    except Exception:  # noqa: BLE001, S110 - the failure is the point
        pass
    else:
        return  # a saver may stringify anything it is given; nothing failed, nothing to clean up
    if folder.exists():
        raise _fail(name, "all or nothing", f"a save that failed midway left {folder} behind",
                    "write into a temporary folder and rename it at the end (layerwise.model_io.saving.atomic_output_dir)")
