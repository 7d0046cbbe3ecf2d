"""Fused MoE experts split into per-expert 2-D weights, by tensor name and byte range, no model built.

transformers 5 keeps a MoE layer's experts fused, as two 3-D tensors on one experts module:

* ``<experts>.gate_up_proj``: ``(experts, 2 * intermediate, hidden)``, each expert's gate rows first;
* ``<experts>.down_proj``: ``(experts, hidden, intermediate)``;

and a checkpoint saved from that layout holds them so. The in-memory run unfuses them into one ``nn.Linear``
per expert and projection (``model_zoo/moe.py``), named ``<experts>.<e>.<gate|up|down>.weight`` with the leaf
names the model patch declares (``ModelPatch.expert_projections``); a model-free run, which sees tensors only,
splits the same tensors into the same names from that declaration alone.

A split is free: each expert's gate, up and down matrix is a contiguous run of rows of its 3-D tensor, so the
per-expert weights are :class:`StoredTensor` byte ranges of the source file (read a chunk of rows at a time, or
copied by the kernel, as any 2-D tensor). A fused tensor of any other shape is refused, never guessed at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from layerwise.model_io.streaming.safetensors_io import DTYPES, StoredTensor

#: the leaf names of transformers 5's fused experts tensors: gate and up rows together, and down
GATE_UP, DOWN = "gate_up_proj", "down_proj"
FLOATING = ("F64", "F32", "F16", "BF16")


class FusedExpertsError(ValueError):
    """Fused experts tensors whose shapes are not the layout the patch declares (the message names them)."""


def is_fused_experts(name: str, stored: StoredTensor) -> bool:
    """Is ``name`` a fused experts tensor (3-D floating ``*.gate_up_proj`` or ``*.down_proj``)?"""
    return (len(stored.shape) == 3 and stored.dtype in FLOATING
            and name.rpartition(".")[2] in (GATE_UP, DOWN))


def fused_experts_tensors(tensors: Mapping[str, object]) -> list[str]:
    """The fused experts tensors of ``tensors`` (name -> :class:`StoredTensor`, or ``(file, StoredTensor)``)."""
    return [name for name, value in tensors.items()
            if is_fused_experts(name, value[1] if isinstance(value, tuple) else value)]  # type: ignore[arg-type]


def expert_weights(name: str, stored: StoredTensor, projections: tuple[str, ...]) -> list[tuple[str, StoredTensor]]:
    """The per-expert 2-D weights of the fused tensor ``name``, named ``<experts>.<e>.<leaf>.weight`` with
    ``projections`` (gate, up, down): for ``gate_up_proj`` each expert's gate then up (its first and second half
    of rows), for ``down_proj`` each expert's down; each a byte range of ``stored``'s file."""
    experts, rows, columns = stored.shape
    prefix, _, leaf = name.rpartition(".")
    gate, up, down = projections
    size = torch.empty((), dtype=DTYPES[stored.dtype]).element_size()
    if leaf == GATE_UP:
        if rows % 2:
            raise FusedExpertsError(f"{name!r} has {rows} rows per expert: gate and up rows fused need an even count")
        parts = ((gate, 0, rows // 2), (up, rows // 2, rows // 2))
    elif leaf == DOWN:
        parts = ((down, 0, rows),)
    else:
        raise FusedExpertsError(f"{name!r} is not a fused experts tensor ({GATE_UP!r} or {DOWN!r})")
    found = []
    for e in range(experts):
        for projection, first, count in parts:
            start = stored.start + (e * rows + first) * columns * size
            found.append((f"{prefix}.{e}.{projection}.weight",
                          dataclasses.replace(stored, shape=(count, columns), start=start, nbytes=count * columns * size)))
    return found


def split_experts(tensors: Mapping[str, StoredTensor], projections: tuple[str, ...]) -> dict[str, StoredTensor]:
    """``tensors`` (one file's, in order) with each fused experts tensor replaced, where it stood, by its per-expert
    weights (:func:`expert_weights`); unchanged when ``projections`` is empty (no patch declares the split)."""
    if not projections:
        return dict(tensors)
    split: dict[str, StoredTensor] = {}
    for name, stored in tensors.items():
        pieces = expert_weights(name, stored, projections) if is_fused_experts(name, stored) else [(name, stored)]
        for piece, where in pieces:
            if piece in split or (piece != name and piece in tensors):
                raise FusedExpertsError(f"splitting {name!r} gives {piece!r}, which the checkpoint already holds")
            split[piece] = where
    return split


def check_experts_pairs(tensors: Mapping[str, StoredTensor]) -> None:
    """Refuse fused experts whose ``gate_up_proj`` and ``down_proj`` disagree (experts, hidden or intermediate
    size): the patch's layout would not hold, and splitting them would write wrong layers."""
    for name in fused_experts_tensors(tensors):
        prefix, _, leaf = name.rpartition(".")
        down = tensors.get(f"{prefix}.{DOWN}")
        if leaf != GATE_UP or down is None or not is_fused_experts(f"{prefix}.{DOWN}", down):
            continue
        experts, rows, hidden = tensors[name].shape
        if tuple(down.shape) != (experts, hidden, rows // 2):
            raise FusedExpertsError(
                f"{name!r} {tuple(tensors[name].shape)} and {prefix}.{DOWN} {tuple(down.shape)} are not the fused "
                f"experts layout (experts, 2 * intermediate, hidden) and (experts, hidden, intermediate): "
                f"model-free cannot split them; pass patch=False to leave them dense")
