"""Unloaded weights: a parameter whose values are still on disk.

An unloaded tensor is a stride-0 view of one NaN element per dtype: it has the real shape
and dtype (so tracing, target resolution and recipes' shape checks work), costs no memory,
and keeps the parameter object that the model, tied weights and traced subgraphs share
(loading is a ``.data`` swap, as :mod:`layerwise.runtime.offload` does). Why NaN and not the meta
device: a meta tensor cannot swap ``.data`` with a real one, and anything that computes
with an unloaded weight by mistake produces NaN, which the run's non-finite checks stop.
"""

from __future__ import annotations

import torch

_SCALARS: dict[torch.dtype, torch.Tensor] = {}


def _scalar(dtype: torch.dtype) -> torch.Tensor:
    if dtype not in _SCALARS:
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
        _SCALARS[dtype] = torch.full((1,), fill, dtype=dtype)
    return _SCALARS[dtype]


def unloaded(shape: torch.Size | list[int] | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A placeholder of ``shape`` and ``dtype`` holding no memory of its own."""
    shape = tuple(shape)
    return _scalar(dtype).reshape(()).expand(shape) if shape else _scalar(dtype).reshape(())


def is_unloaded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a placeholder made by :func:`unloaded`."""
    scalar = _SCALARS.get(tensor.dtype)
    return (scalar is not None and tensor.device.type == "cpu"
            and tensor.untyped_storage().data_ptr() == scalar.untyped_storage().data_ptr())


def unload(tensor: torch.Tensor) -> None:
    """Drop ``tensor``'s values, keeping the object (its holders see the placeholder)."""
    tensor.data = unloaded(tensor.shape, tensor.dtype)
