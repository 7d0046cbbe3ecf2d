"""Output shards written as the run goes: each finished piece's tensors become one safetensors part file.

Why one file per piece: the piece's tensors are in memory anyway when it is finished, so
writing them needs no second copy, and after a crash every finished piece is already on disk
(what resume reads back). :meth:`ShardWriter.finish` gathers the parts into shards of the usual
size (copying bytes file to file), names them as transformers expects and writes the index.

The merge can be interrupted (Ctrl-C, a kill, a full disk) after it consumed parts a resume
checkpoint lists. So it first writes its plan (:data:`MERGE_PLAN`: which parts make which shard),
writes each shard completely before removing its parts, and removes the plan last: a resumed run
finishes the merge from whatever is there (:meth:`ShardWriter.complete_merge`), and
:func:`missing_files` tells a folder that can be continued from one that cannot.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from layerwise.common.files import replace_file
from layerwise.model_io.streaming.safetensors_io import StoredTensor, read_header, write_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PART_PREFIX = "part-"
#: the merge's plan, present while :meth:`ShardWriter.finish` turns parts into shards
MERGE_PLAN = ".layerwise-merge.json"
#: the largest shard a streamed run writes (as transformers' ``save_pretrained`` shards: 5 GiB)
MAX_SHARD_BYTES = 5 * 2**30


def missing_files(folder: Path, parts: list[str]) -> list[str]:
    """The part files ``folder`` needs and lacks: listed ones, or (a merge begun) those of a shard not yet written."""
    plan = _read_plan(folder)
    if plan is None:
        return [part for part in parts if not (folder / part).is_file()]
    return [part for name, group in plan["shards"] if not (folder / name).is_file()
            for part in group if not (folder / part).is_file()]


def _read_plan(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MERGE_PLAN).read_text())
    except FileNotFoundError:
        return None


class ShardWriter:
    """Writes groups of tensors into ``folder`` as numbered part files, then names them as shards."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.weight_map: dict[str, str] = {}
        self.parts: list[str] = []
        self.total_bytes = 0
        #: the shards are complete (a resumed run finished an interrupted merge): what is written again is there
        self.merged = False

    def write(self, tensors: dict[str, torch.Tensor | StoredTensor],
              written: Callable[[torch.Tensor], None] | None = None) -> None:
        """Write ``tensors`` (tensors, or byte ranges of the source checkpoint) as the next part file."""
        if not tensors or self._already_merged(tensors):
            return
        name = f"{PART_PREFIX}{len(self.parts):05d}.safetensors"
        clash = [k for k in tensors if k in self.weight_map]
        if clash:
            raise ValueError(f"tensors written twice: {clash[:3]}")
        self.total_bytes += write_file(self.folder / name, tensors, written)  # complete or absent
        self.parts.append(name)
        self.weight_map.update(dict.fromkeys(tensors, name))

    def _already_merged(self, tensors: dict) -> bool:
        """A resumed run whose merge was completed writes its last tensors again: they are in the shards."""
        if not self.merged:
            return False
        new = [k for k in tensors if k not in self.weight_map]
        if new:
            raise ValueError(f"tensors written after the shards were completed: {new[:3]}")
        return True

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
        if self.merged:
            return list(self.parts)
        plan = {"shards": self._plan(max_shard_bytes), "weight_map": self.weight_map, "total_bytes": self.total_bytes}
        replace_file(self.folder / MERGE_PLAN, json.dumps(plan))
        return self._merge(plan)

    def complete_merge(self) -> bool:
        """Finish a merge an interrupted run began (its plan is in the folder); ``False`` when none was begun."""
        plan = _read_plan(self.folder)
        if plan is None:
            return False
        self.weight_map, self.total_bytes = dict(plan["weight_map"]), plan["total_bytes"]
        self._merge(plan)
        self.merged = True
        return True

    def _plan(self, max_shard_bytes: int) -> list[tuple[str, list[str]]]:
        """Which parts make which shard, in order."""
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
        return list(zip(names, groups))

    def _merge(self, plan: dict) -> list[str]:
        """Write the planned shards (one done before is kept), then the index; the plan goes last."""
        shards = [(name, list(group)) for name, group in plan["shards"]]
        weight_map = {}
        for name, group in shards:
            weight_map.update(dict.fromkeys(self._merge_one(name, group), name))
        if len(shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes},
                     "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        self.parts, self.weight_map = [name for name, _ in shards], weight_map
        (self.folder / MERGE_PLAN).unlink()
        return list(self.parts)

    def _merge_one(self, name: str, group: list[str]) -> dict[str, StoredTensor]:
        """Shard ``name`` from ``group``, written whole before a part is removed; returns its tensors."""
        shard = self.folder / name
        if all((self.folder / part).is_file() for part in group):
            if len(group) == 1:
                os.replace(self.folder / group[0], shard)
            else:
                stored: dict[str, StoredTensor] = {}
                for part in group:
                    stored.update(read_header(self.folder / part))
                write_file(shard, stored)
        for part in group:  # those a merge interrupted after the shard was written, too
            (self.folder / part).unlink(missing_ok=True)
        return read_header(shard)
