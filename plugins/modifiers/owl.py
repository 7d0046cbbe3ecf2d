"""OWL: a sparsity per block from its share of outlier weights, keeping the model's mean sparsity.

Blocks whose weights carry more outliers lose fewer of them. A weight's importance is
Wanda's ``|W| x ||X||``; a block's outlier ratio is the fraction of its layers' weights whose
importance exceeds ``m`` times the block's mean. The ratios are scaled to ``[0, 2 lmbda]``
and each block gets ``sparsity - (ratio - mean ratio)``: the mean over blocks is the asked
sparsity, and the most and the least pruned blocks are ``2 lmbda`` apart. The inputs' norms
come from one forward of the dense model over the calibration batches, before any pruning.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from layerwise.plugin.quantization import linear_weight

from .hessians import layer_input


def owl_sparsities(layers: dict[str, torch.nn.Module], blocks: Iterable[str], norms: dict[str, torch.Tensor],
                   sparsity: float, m: float, lmbda: float) -> dict[str, float]:
    """Per layer, the sparsity of its block (``blocks``: qualified names; a layer in none is its own)."""
    blocks = sorted(blocks, key=len, reverse=True)  # the innermost block that holds a layer
    groups: dict[str, list[str]] = {}
    for name in layers:
        owner = next((b for b in blocks if name == b or name.startswith(b + ".")), name)
        groups.setdefault(owner, []).append(name)
    ratios = {}
    for owner, names in groups.items():
        scores = torch.cat([_importance(layers[n], norms.get(n)).reshape(-1) for n in names])
        ratios[owner] = float((scores > m * scores.mean()).to(torch.float64).mean())
    low, high = min(ratios.values()), max(ratios.values())
    span = high - low
    scaled = {b: (r - low) / span * 2 * lmbda if span > 0 else 0.0 for b, r in ratios.items()}
    mean = sum(scaled.values()) / len(scaled)
    return {n: sparsity - (scaled[owner] - mean) for owner, names in groups.items() for n in names}


def _importance(layer: torch.nn.Module, norm: torch.Tensor | None) -> torch.Tensor:
    weight = linear_weight(layer).detach().to(torch.float32).abs()
    return weight if norm is None else weight * norm.to(weight.device).sqrt().unsqueeze(0)


@torch.no_grad()
def input_norms(model: torch.nn.Module, layers: dict[str, torch.nn.Module], batches: list[Any]) -> dict[str, torch.Tensor]:
    """Each layer's per-input-column sum of squares over every batch, from one plain forward of ``model``."""
    sums: dict[str, torch.Tensor] = {}

    def hook(name):
        def collect(module, args, kwargs):
            x = layer_input(args, kwargs)
            if isinstance(x, torch.Tensor):
                squares = x.detach().reshape(-1, x.shape[-1]).to(torch.float32).square().sum(0)
                sums[name] = squares if name not in sums else sums[name].add_(squares)
        return collect

    handles = [layer.register_forward_pre_hook(hook(name), with_kwargs=True) for name, layer in layers.items()]
    device = next(model.parameters()).device
    try:
        for batch in batches:
            if isinstance(batch, dict):
                model(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()})
            else:
                model(batch.to(device))
    finally:
        for handle in handles:
            handle.remove()
    return sums
