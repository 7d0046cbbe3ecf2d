"""Writing the generated package: every file appears at once, or none does.

The files go into a temporary sibling of the output folder that becomes it in one
rename (:func:`layerwise.saving.atomic_output_dir`), so an error half way leaves no
half package behind, and an existing folder is replaced only with ``overwrite``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from ..saving import atomic_output_dir, check_output_dir


def check_target(output_dir: str | os.PathLike, overwrite: bool) -> Path:
    """The output folder as an absolute Path; an error before any work when it may not be written."""
    return check_output_dir(output_dir, overwrite)


def write_package(files: Mapping[str, str], output_dir: str | os.PathLike, overwrite: bool = False) -> Path:
    """Write ``files`` (relative path -> text) as the folder ``output_dir``; returns its absolute path."""
    with atomic_output_dir(output_dir, overwrite) as tmp:
        for relative, text in files.items():
            path = tmp / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
    return Path(output_dir).expanduser().absolute()
