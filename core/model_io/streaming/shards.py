"""Output shards written as the run goes: each finished piece's tensors become one safetensors part file.

Why one file per piece: the piece's tensors are in memory anyway when it is finished, so
writing them needs no second copy, and after a crash every finished piece is already on disk
(what resume reads back). :meth:`ShardWriter.finish` gathers the parts into shards of the usual
size (copying bytes file to file), names them as transformers expects and writes the index.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from layerwise.model_io.streaming.safetensors_io import StoredTensor, read_header, write_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PART_PREFIX = "part-"


#: the largest shard a streamed run writes (as transformers' ``save_pretrained`` shards: 5 GiB)
MAX_SHARD_BYTES = 5 * 2**30

class ShardWriter:
    """Writes groups of tensors into ``folder`` as numbered part files, then names them as shards."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.weight_map: dict[str, str] = {}
        self.parts: list[str] = []
        self.total_bytes = 0

    def write(self, tensors: dict[str, torch.Tensor | StoredTensor],
              written: Callable[[torch.Tensor], None] | None = None) -> None:
        """Write ``tensors`` (tensors, or byte ranges of the source checkpoint) as the next part file."""
        if not tensors:
            return
        name = f"{PART_PREFIX}{len(self.parts):05d}.safetensors"
        clash = [k for k in tensors if k in self.weight_map]
        if clash:
            raise ValueError(f"tensors written twice: {clash[:3]}")
        self.total_bytes += write_file(self.folder / name, tensors, written)  # complete or absent
        self.parts.append(name)
        self.weight_map.update(dict.fromkeys(tensors, name))

    def restore(self, parts: list[str], weight_map: dict[str, str], total_bytes: int) -> None:
        """Continue after the parts a previous (interrupted) run wrote."""
        self.parts, self.weight_map, self.total_bytes = list(parts), dict(weight_map), total_bytes

    def rewrite(self, keys: set[str], encode: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]) -> None:
        """Replace each of ``keys`` in the parts by what ``encode(key, tensor)`` returns (one tensor in memory
        at a time; the other tensors' bytes are copied as they are)."""
        from layerwise.model_io.streaming.safetensors_io import MappedFiles

        for position, part in enumerate(self.parts):
            stored = read_header(self.folder / part)
            if not keys & set(stored):
                continue
            mapped = MappedFiles()
            tensors: dict[str, torch.Tensor | StoredTensor] = {}
            for key, where in stored.items():
                tensors.update(encode(key, mapped.tensor(where).clone()) if key in keys else {key: where})
            self.total_bytes += write_file(self.folder / part, tensors) - sum(w.nbytes for w in stored.values())
            mapped.close()
            self.weight_map = {k: v for k, v in self.weight_map.items() if v != part}
            self.weight_map.update(dict.fromkeys(tensors, part))
            self.parts[position] = part

    def finish(self, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
        """Gather the parts into shards of at most ``max_shard_bytes`` (``model-0000i-of-0000n.safetensors``;
        one: ``model.safetensors``), bytes copied file to file, and write the index; returns the shard names."""
        groups: list[list[str]] = []
        size = 0
        for part in self.parts:
            part_size = (self.folder / part).stat().st_size
            if not groups or size + part_size > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(part)
            size += part_size
        count = len(groups)
        names = [SINGLE_FILE] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        weight_map = {}
        for group, name in zip(groups, names):
            if len(group) == 1:
                os.replace(self.folder / group[0], self.folder / name)
                stored = read_header(self.folder / name)
            else:
                stored = {}
                for part in group:
                    stored.update(read_header(self.folder / part))
                write_file(self.folder / name, stored)
                for part in group:
                    (self.folder / part).unlink()
            weight_map.update(dict.fromkeys(stored, name))
        if count > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        self.parts, self.weight_map = list(names), weight_map
        return names
