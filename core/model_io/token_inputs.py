"""Dynamic per-token input scales taken per row on a loaded model, whatever the rank of a layer's input.

compressed-tensors 0.20 computes a dynamic ``token`` input scale by reducing every dimension but the first
two: one scale per token for a ``(batch, seq, features)`` input, but one per sequence for DeepSeek-V3's
``kv_b_proj``, which transformers 5.24 feeds its latent as ``(batch, 1, seq, rank)``, and one for the
whole tensor on a 2-D input. layerwise's compressed model and vLLM take one scale per row (per token), so
a reloaded FP8_DYNAMIC DeepSeek-V3 drifted from both (0.01 to 0.1 on the tiny model's logits).
:func:`quantize_inputs_per_row` has compressed-tensors' forward see every input as ``(rows, 1, features)``,
where its scale is per row, and gives the output back in the input's shape.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch

#: marks a forward already wrapped by :func:`_by_rows` (a second load step must not wrap it twice)
_BY_ROWS = "_layerwise_inputs_by_rows"


def quantize_inputs_per_row(model: torch.nn.Module) -> list[str]:
    """Wrap the forward of every Linear layer compressed-tensors gave dynamic per-token input quantization so
    that its scales are per row; returns the layers wrapped."""
    wrapped = []
    for name, module in model.named_modules():
        if _per_token_dynamic_inputs(module) and not getattr(module.forward, _BY_ROWS, False):
            module.forward = types.MethodType(_by_rows(module.forward), module)
            wrapped.append(name)
    return wrapped


def _per_token_dynamic_inputs(module: torch.nn.Module) -> bool:
    """A Linear layer whose compressed-tensors scheme quantizes its inputs dynamically, one scale per token."""
    scheme = getattr(module, "quantization_scheme", None)
    inputs = getattr(scheme, "input_activations", None)
    return (isinstance(module, torch.nn.Linear) and inputs is not None and inputs.dynamic is True
            and str(getattr(inputs.strategy, "value", inputs.strategy)) == "token")


def _by_rows(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``forward`` run on its input viewed as ``(rows, 1, features)``, the output in the input's leading shape;
    a method (compressed-tensors' offloading wraps a layer's ``forward.__func__`` on the first forward)."""

    def by_rows(_self: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = forward(x.reshape(-1, 1, x.shape[-1]), *args, **kwargs)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    setattr(by_rows, _BY_ROWS, True)
    return by_rows
