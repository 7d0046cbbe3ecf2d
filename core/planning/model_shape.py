"""The model of a folder built on the meta device from its config: shapes without a weight read.

Sizes on disk come from the safetensors headers (a few KB per shard); the class is chosen as
``load_model`` chooses it (:func:`~layerwise.model_io.heads.checkpoint_class`), its patch applied.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layerwise.model_io.streaming.checkpoint import INDEX_FILE, SINGLE_FILE
from layerwise.model_io.streaming.safetensors_io import read_header
from layerwise.model_io.streaming.skeleton import config_dtype


@dataclass(frozen=True)
class CheckpointInfo:
    """A folder's safetensors files from their headers: tensor count, bytes, shards."""

    tensors: int
    bytes: int
    shards: int
    largest_shard: int
    names: frozenset[str]


def checkpoint_info(folder: Path) -> CheckpointInfo | None:
    """The folder's safetensors weights as their headers describe them; ``None`` when it has none."""
    index = folder / INDEX_FILE
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        return None
    names: set[str] = set()
    sizes = []
    for file in files:
        stored = read_header(folder / file)
        names.update(stored)
        sizes.append(sum(t.nbytes for t in stored.values()))
    return CheckpointInfo(len(names), sum(sizes), len(files), max(sizes, default=0), frozenset(names))


def meta_model(folder: str | Path, patch: Any = None, trust_remote_code: bool = False
               ) -> tuple[torch.nn.Module, CheckpointInfo | None]:
    """The folder's model on the meta device (in the dtype ``load_model`` gives), its patch applied."""
    import transformers

    from layerwise.host.patch_selection import apply_patch, resolve_patch
    from layerwise.model_io.heads import checkpoint_class
    from layerwise.model_io.load_errors import explained

    path = Path(folder).expanduser()
    with explained(str(path)):
        config = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    info = checkpoint_info(path) if path.is_dir() else None
    cls = checkpoint_class(config, path, set(info.names) if info else None)
    with torch.device("meta"):  # an Auto class (a config without ``architectures``) has from_config only
        build = getattr(cls, "_from_config", None) or cls.from_config
        model = build(config, dtype=config_dtype(config))
    model.eval()
    return apply_patch(model, resolve_patch(model, patch)), info
