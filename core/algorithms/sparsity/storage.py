"""Where a pruning result lives on a module, for later modifiers and the saver.

A pruned module keeps its ordinary (dense) ``weight`` with zeros where weights were
pruned, plus ``sparsity_structure`` (a :class:`~.masks.MaskStructure`). That record is what
tells :class:`~layerwise.plugins.modifiers.gptq.GPTQModifier` to keep the zeros, and the
saver to write a sparse checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from layerwise.algorithms.sparsity.masks import MaskStructure

SPARSITY_ATTR = "sparsity_structure"
#: config.json's key for the sparsity_config of a model pruned and not quantized: compressed-tensors 0.19 writes no
#: quantization_config for such a model, and transformers with it fails to load one that has no config group
PRUNED_ONLY_KEY = "layerwise_sparsity_config"


def mark_sparse(module: nn.Module, structure: MaskStructure) -> None:
    """Record that ``module``'s weight zeros are a pruning mask of ``structure``."""
    setattr(module, SPARSITY_ATTR, structure)


def sparse_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module a pruning modifier marked, by qualified name."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, SPARSITY_ATTR, None), MaskStructure)}


def sparsity_of(module: nn.Module) -> float:
    """The fraction of the module's weight that is exactly zero."""
    weight = module.weight.detach()
    return float((weight == 0).sum()) / max(weight.numel(), 1)


def pruned_mask(module: nn.Module) -> torch.Tensor | None:
    """The ``(out, in)`` mask (``True`` = pruned) of a marked module, else ``None``."""
    if not isinstance(getattr(module, SPARSITY_ATTR, None), MaskStructure):
        return None
    from layerwise.algorithms.quantization.storage import linear_weight

    return linear_weight(module).detach() == 0
