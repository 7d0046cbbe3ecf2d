"""Applying per-channel smoothing scales to a resolved mapping, exactly.

For scales ``s`` (one per channel the smoothed module produces): the smoothed module's output
channel ``j`` is divided by ``s[j]`` and every balance layer's input column ``j`` multiplied by
``s[j]``, so the model computes the same function (up to rounding) while the balance layers'
inputs get flatter (SmoothQuant) or their salient columns larger (AWQ).

Norms come in two kinds: ``y = w * norm(x) (+ b)`` (Llama, BERT) and ``y = (1 + w) * norm(x)``
(Gemma); which one a module is, is measured on the module itself (its output with ``w = 0``),
not guessed from its class name.
"""

from __future__ import annotations

import copy

import torch

from layerwise.algorithms.quantization.mappings import ResolvedMapping, output_width
from layerwise.algorithms.quantization.storage import linear_weight


@torch.no_grad()
def apply_smoothing(model: torch.nn.Module, mapping: ResolvedMapping, scales: torch.Tensor) -> None:
    """Fold ``1 / scales`` into ``mapping.smoothed`` and ``scales`` into each balance layer's columns."""
    smoothed = model.get_submodule(mapping.smoothed)
    width = output_width(smoothed)
    if scales.dim() != 1 or scales.numel() != width:
        raise ValueError(f"{mapping.smoothed} produces {width} channels, got {tuple(scales.shape)} scales")
    if not bool((scales > 0).all()) or not bool(torch.isfinite(scales).all()):
        raise ValueError(f"smoothing scales for {mapping.smoothed} must be finite and positive")
    scales = scales.to(torch.float32)
    _divide_output(smoothed, scales)
    for name in mapping.balance:
        weight = linear_weight(model.get_submodule(name))
        weight.copy_((weight.to(torch.float32) * scales.to(weight.device)).to(weight.dtype))


def _divide_output(module: torch.nn.Module, scales: torch.Tensor) -> None:
    bias = getattr(module, "bias", None)
    if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
        weight = linear_weight(module)
        weight.copy_((weight.to(torch.float32) / scales.to(weight.device)[:, None]).to(weight.dtype))
    else:
        weight = module.weight
        s = scales.to(weight.device)
        if has_unit_offset(module):  # y = (1 + w) * norm(x)
            weight.copy_(((1 + weight.to(torch.float32)) / s - 1).to(weight.dtype))
        else:
            weight.copy_((weight.to(torch.float32) / s).to(weight.dtype))
    if isinstance(bias, torch.Tensor):
        bias.copy_((bias.to(torch.float32) / scales.to(bias.device)).to(bias.dtype))


@torch.no_grad()
def has_unit_offset(norm: torch.nn.Module) -> bool:
    """Does ``norm`` scale by ``1 + weight`` (Gemma's RMSNorm) rather than ``weight``? Measured: with a
    zero weight (and bias) a plain norm outputs zeros, an offset one does not."""
    probe = copy.deepcopy(norm).to(torch.float32)
    probe.weight.zero_()
    if isinstance(getattr(probe, "bias", None), torch.Tensor):
        probe.bias.zero_()
    x = torch.randn(2, probe.weight.shape[0], generator=torch.Generator().manual_seed(0))
    return bool(probe(x.to(probe.weight.device)).abs().max() > 0)
