"""Reading single tensors from a safetensors checkpoint (one file or sharded), memory-mapped.

Why not ``from_pretrained``: it materializes every weight at once. Here each tensor is read
when a piece of the model needs it and nothing else of the file becomes resident.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from layerwise.errors import ModelLoadError
from layerwise.model_io.streaming.safetensors_io import (
    MappedFiles,
    SafetensorsError,
    StoredTensor,
    read_header,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ModelLoadError):
    """The folder's weights cannot be streamed (no safetensors, a key the model does not have, ...)."""


class Checkpoint:
    """The tensors of a model folder's safetensors files, by name; opened lazily, read one at a time."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser()
        self.files = self._index()
        self._stored: dict[str, StoredTensor] = {}
        for file in dict.fromkeys(self.files.values()):
            self._stored.update(_header(self.folder / file))
        self.mapped = MappedFiles()

    def _index(self) -> dict[str, str]:
        """Tensor name -> file name (relative to the folder)."""
        index = self.folder / INDEX_FILE
        if index.is_file():
            return dict(json.loads(index.read_text())["weight_map"])
        single = self.folder / SINGLE_FILE
        if single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as handle:
                return dict.fromkeys(handle.keys(), SINGLE_FILE)
        found = sorted(p.name for p in self.folder.glob("*.bin")) or sorted(p.name for p in self.folder.glob("*.pt"))
        hint = f" (it has {', '.join(found)})" if found else ""
        raise CheckpointError(f"{str(self.folder)!r} has no {SINGLE_FILE} or {INDEX_FILE}{hint}: streaming weights "
                              f"from disk reads safetensors only. Re-save the model with save_pretrained() "
                              f"(safetensors is its default), or pass weights='memory' (CLI: --weights memory)")

    def names(self) -> list[str]:
        return list(self.files)

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def read(self, key: str) -> torch.Tensor:
        """Tensor ``key`` as stored (dtype and all): a copy-on-write view of the file, whose pages become
        resident only when read (:meth:`release` gives them back)."""
        return self.mapped.tensor(self.stored(key))

    def stored(self, key: str) -> StoredTensor:
        """Where ``key``'s bytes are (for copying them unchanged)."""
        if key not in self._stored:
            raise CheckpointError(f"{self.files[key]} has no tensor {key!r} although the index names it there")
        return self._stored[key]

    def release(self, tensor: torch.Tensor) -> None:
        self.mapped.release(tensor)

    def close(self) -> None:
        self.mapped.close()


def _header(path: Path) -> dict[str, StoredTensor]:
    try:
        return read_header(path)
    except SafetensorsError as exc:
        raise CheckpointError(f"{exc}: download it again, or save it again with save_pretrained()") from exc
    except FileNotFoundError as exc:
        raise CheckpointError(f"'{path.name}' is named by the checkpoint's index but missing from "
                              f"{str(path.parent)!r}: download it again") from exc


def checkpoint_bytes(folder: str | Path) -> int | None:
    """Bytes of a folder's safetensors weights (from the file sizes alone), ``None`` when it has none."""
    folder = Path(folder).expanduser()
    index = folder / INDEX_FILE
    try:
        if index.is_file():
            files = set(json.loads(index.read_text())["weight_map"].values())
            return sum((folder / f).stat().st_size for f in files if (folder / f).is_file())
    except (OSError, ValueError, KeyError, AttributeError):
        return None
    single = folder / SINGLE_FILE
    return single.stat().st_size if single.is_file() else None
