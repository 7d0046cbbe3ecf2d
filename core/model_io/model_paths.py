"""Telling a local model folder from a hub id, and refusing a folder that is not there, at once."""

from __future__ import annotations

import os
from pathlib import Path

from layerwise.errors import ModelLoadError


def looks_like_path(where: str) -> bool:
    """Whether ``where`` can only be a folder, never a hub id (``name`` or ``org/name``).

    It starts with ``.``, ``~`` or ``/``, ends with a separator, has a backslash (no hub id has
    one) or more than one ``/``.
    """
    return where.startswith((".", "~", "/")) or where.endswith("/") or "\\" in where or where.count("/") > 1


def check_model_path(where: str | os.PathLike) -> None:
    """Refuse a model folder that is not there, or holds no config.json, before anything loads.

    A path-like name that does not exist is a local typo: asking the hub for it would only
    retry for half a minute (offline) and then fail with a message about repository ids.
    """
    where = str(where)
    path = Path(where).expanduser()
    if path.exists() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{where!r} has no config.json: pass a folder saved by transformers "
                             f"(save_pretrained) or a model id")
    if not path.exists() and looks_like_path(where):
        raise ModelLoadError(f"model folder {where!r} does not exist")
