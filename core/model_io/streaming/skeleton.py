"""The model without its weights: built from config.json with every parameter unloaded.

Buffers are built for real (a rotary table is computed, not read), parameters are created on
the meta device (no memory, no initialisation work) and then replaced by placeholders that
keep their shape, dtype and tying (:mod:`.placeholders`). Persistent buffers the checkpoint
holds are read from it, as ``from_pretrained`` would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from layerwise.model_io.streaming.checkpoint import Checkpoint
from layerwise.runtime.placeholders import unloaded


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside the block lives on the meta device; buffers stay real."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def config_dtype(config: Any) -> torch.dtype:
    """The dtype ``from_pretrained(dtype="auto")`` gives: the config's, else float32."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def build_skeleton(cls: type, config: Any, dtype: torch.dtype) -> nn.Module:
    """An instance of ``cls`` for ``config`` whose parameters are placeholders (tied ones stay tied)."""
    with parameters_on_meta():
        model = cls._from_config(config, dtype=dtype)
    replaced: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                replaced[id(param)] = nn.Parameter(unloaded(param.shape, param.dtype), requires_grad=False)
            module._parameters[name] = replaced[id(param)]
    model.eval()
    return model


def load_persistent_buffers(model: nn.Module, checkpoint: Checkpoint) -> None:
    """Persistent buffers the checkpoint holds are read from it (cast to the buffer's dtype)."""
    for module_name, module in model.named_modules():
        for name, buffer in module._buffers.items():
            key = f"{module_name}.{name}" if module_name else name
            if buffer is None or name in module._non_persistent_buffers_set or key not in checkpoint:
                continue
            buffer.data = checkpoint.read(key).to(buffer.dtype)

