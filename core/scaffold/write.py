"""Writing the generated package: every file appears at once, or none does.

The files go into a temporary sibling of the output folder that becomes it in one
rename (:func:`layerwise.model_io.saving.atomic_output_dir`), so an error half way leaves no
half package behind. An existing folder is replaced with ``overwrite=True`` only when it is a
plugin package (its ``pyproject.toml`` registers ``layerwise`` entry points); ``"any"`` replaces
any folder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from layerwise.model_io.saving import Overwrite, atomic_output_dir, check_output_dir

#: the table a generated package's pyproject.toml registers its patch under
ENTRY_POINTS = "[project.entry-points.layerwise]"


def is_plugin_package(folder: Path) -> bool:
    """Whether ``folder`` holds a layerwise plugin package (what ``overwrite=True`` may replace)."""
    try:
        return ENTRY_POINTS in (folder / "pyproject.toml").read_text(encoding="utf-8")
    except OSError:
        return False


def check_target(output_dir: str | os.PathLike, overwrite: Overwrite) -> Path:
    """The output folder as an absolute Path; an error before any work when it may not be written."""
    return check_output_dir(output_dir, overwrite, owned=is_plugin_package)


def write_package(files: Mapping[str, str], output_dir: str | os.PathLike, overwrite: Overwrite = False) -> Path:
    """Write ``files`` (relative path -> text) as the folder ``output_dir``; returns its absolute path."""
    check_target(output_dir, overwrite)
    # checked above against this kind of folder; the swap below must not ask for a run summary
    with atomic_output_dir(output_dir, "any" if overwrite else False) as tmp:
        for relative, text in files.items():
            path = tmp / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    return Path(output_dir).expanduser().absolute()
