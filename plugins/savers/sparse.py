"""The sparse half of the compressed-tensors saver: ``sparsity_config``, and the weights kept dense.

A pruned model's weights are stored as they are: dense with their zeros, or packed when a quantizer
followed the pruner. ``quantization_config.sparsity_config`` (format ``dense``) records what the
zeros are. That is the one layout plain transformers loads: compressed-tensors >= 0.15 dropped the
``sparse-bitmask`` / ``sparse-24-bitmask`` decompressors, and transformers 5.24 reads a folder in
those layouts with its pruned weights missing (randomly initialised, measured). A ``dense``
sparsity_config with no config groups loads as a plain dense model (also measured), and with
quantization as the quantized format it sits in. Folders that older layerwise releases wrote in the
bitmask layouts still load with :func:`layerwise.load_compressed` (which decodes them).

``sparsity_config`` is built and dumped by compressed-tensors' own config classes:
``targets`` are the pruned layers' exact qualified names, ``ignore`` the other Linear layers,
``global_sparsity`` the fraction of zeros over the pruned weights, ``sparsity_structure`` the
layers' common structure ("2:4", "unstructured", ...; "unstructured" when they differ). A layer
marked N:M is checked to be N:M before anything is written: an inference server may run a 2:4
``sparsity_structure`` with 2:4 kernels, which would drop the weights a wrong mark leaves out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layerwise.plugin.quantization import is_transposed, linear_weight
from layerwise.plugin.sparsity import SPARSITY_ATTR, MaskStructure

from .errors import SaveError

#: sparsity_config's format: the zeros stay in the (quantized or dense) weights
DENSE = "dense"


def check_sparse_layers(modules: dict[str, nn.Module]) -> None:
    """Refuse pruned layers the format cannot hold, before anything is encoded or written."""
    for name, module in modules.items():
        if is_transposed(module):
            raise SaveError(f"pruned layer {name!r} is a transformers Conv1D (GPT-2 style, weight stored (in, out)); "
                            f"the compressed-tensors sparsity_config is written for nn.Linear only, so this model "
                            f"cannot be saved in this format yet: leave {name!r} out of the pruning (ignore=)")


@torch.no_grad()
def check_marked_structure(modules: dict[str, nn.Module]) -> None:
    """Refuse a layer marked N:M whose weight has fewer than N zeros in some run of M input columns."""
    for name, module in modules.items():
        structure: MaskStructure = getattr(module, SPARSITY_ATTR)
        if structure.unstructured:
            continue
        n, m = structure.n, structure.m
        weight = linear_weight(module).detach()
        rows, cols = weight.shape
        if cols % m:
            raise SaveError(f"pruned layer {name!r} is marked {structure} but its {cols} input columns are not a "
                            f"multiple of {m}")
        zeros = (weight.reshape(rows, cols // m, m) == 0).sum(dim=-1)
        crowded = zeros < n
        if bool(crowded.any()):
            row, run = (int(i) for i in crowded.nonzero()[0])
            raise SaveError(f"pruned layer {name!r} is marked {structure} but {int(crowded.sum())} run(s) of {m} "
                            f"columns hold fewer than {n} zeros (the first: row {row}, columns {m * run}-"
                            f"{m * run + m - 1}), so its sparsity_config would promise a structure the weight does "
                            f"not have. Prune it again, or mark it unstructured "
                            f"(layerwise.plugin.sparsity.mark_sparse(module, MaskStructure(0, 0)))")


def build_sparsity_config(model: nn.Module, pruned: dict[str, nn.Module], fmt: str = DENSE,
                          counts: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """``quantization_config.sparsity_config`` (validated by compressed-tensors' config classes).

    ``counts`` (zeros, weights) per pruned layer, when their weights are no longer in memory.
    """
    from compressed_tensors.config import DenseSparsityConfig

    if fmt != DENSE:
        raise SaveError(f"layerwise writes sparsity_config format {DENSE!r} only (the layout transformers loads), "
                        f"not {fmt!r}")
    structures = {str(getattr(m, SPARSITY_ATTR)) for m in pruned.values()}
    structure = structures.pop() if len(structures) == 1 else "unstructured"
    if counts is None:
        counts = {n: (int((m.weight.detach() == 0).sum()), m.weight.numel()) for n, m in pruned.items()}
    zeros = sum(counts[n][0] for n in pruned)
    total = sum(counts[n][1] for n in pruned)
    ignore = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in pruned]
    config = DenseSparsityConfig(targets=list(pruned), ignore=ignore, global_sparsity=zeros / max(total, 1),
                                 sparsity_structure=structure)
    return config.model_dump(mode="json")
