"""What a model's tensors take on disk: each shared tensor counted once, as a save writes it."""

from __future__ import annotations

import torch

from layerwise.runtime.placeholders import is_unloaded


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each shared (tied) tensor counted once."""
    seen: set[tuple] = set()
    return sum(p.numel() * p.element_size() for p in model.parameters() if first_time(p, seen))


def first_time(tensor: torch.Tensor, seen: set[tuple]) -> bool:
    """Whether ``tensor``'s bytes are new to ``seen`` (then recorded); the same view of one storage is not.

    A tensor without real storage (meta, or a weight still on disk: placeholders share one element)
    is told apart by identity only.
    """
    pointer = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" and not is_unloaded(tensor) else 0
    key = ((str(tensor.device), pointer, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
           if pointer else ("id", id(tensor)))
    if key in seen:
        return False
    seen.add(key)
    return True
