"""The sparse half of the compressed-tensors saver: ``sparsity_config`` and the bitmask tensors.

Which layout a pruned model gets (:func:`sparse_format`):

* **nothing quantized**: the pruned weights are stored compressed, ``sparse-24-bitmask`` when
  every pruned layer is 2:4, else ``sparse-bitmask`` (layouts: :mod:`layerwise.algorithms.sparsity.bitmask`);
  about half the bytes at 50 %. transformers and compressed-tensors >= 0.15 no longer decode
  them: :func:`layerwise.load_compressed` does.
* **some layer quantized**: every weight stays as the quantization saver writes it (packed
  int4 is denser than a bitmask of int4 values, and it is what vLLM and transformers load);
  ``sparsity_config`` with format ``dense`` only records what the zeros are.

``sparsity_config`` is built and dumped by compressed-tensors' own config classes:
``targets`` are the pruned layers' exact qualified names, ``ignore`` the other Linear layers,
``global_sparsity`` the fraction of zeros over the pruned weights, ``sparsity_structure`` the
layers' common structure ("2:4", "unstructured", ...; "unstructured" when they differ).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layerwise.plugin.quantization import is_transposed
from layerwise.plugin.sparsity import (
    BITMASK,
    ENCODERS,
    SPARSE_24,
    SPARSITY_ATTR,
    MaskStructure,
    SparseFormatError,
)

from .errors import SaveError

#: sparsity_config's format when the zeros stay in the (quantized or dense) weights
DENSE = "dense"


def check_sparse_layers(modules: dict[str, nn.Module]) -> None:
    """Refuse pruned layers the format cannot hold, before anything is encoded or written."""
    for name, module in modules.items():
        if is_transposed(module):
            raise SaveError(f"pruned layer {name!r} is a transformers Conv1D (GPT-2 style, weight stored (in, out)); "
                            f"the compressed-tensors sparse layouts are written for nn.Linear only, so this model "
                            f"cannot be saved in this format yet: leave {name!r} out of the pruning (ignore=)")


def sparse_format(pruned: dict[str, nn.Module], quantized: dict[str, nn.Module]) -> str:
    """``dense`` beside quantization, ``sparse-24-bitmask`` when every pruned layer is 2:4, else ``sparse-bitmask``."""
    if quantized:
        return DENSE
    two_four = all(getattr(m, SPARSITY_ATTR) == MaskStructure(2, 4) for m in pruned.values())
    return SPARSE_24 if two_four else BITMASK


def build_sparsity_config(model: nn.Module, pruned: dict[str, nn.Module], fmt: str,
                          counts: dict[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """``quantization_config.sparsity_config`` (validated by compressed-tensors' config classes).

    ``counts`` (zeros, weights) per pruned layer, when their weights are no longer in memory.
    """
    from compressed_tensors.config import BitmaskConfig, DenseSparsityConfig, Sparse24BitMaskConfig

    classes = {DENSE: DenseSparsityConfig, BITMASK: BitmaskConfig, SPARSE_24: Sparse24BitMaskConfig}
    structures = {str(getattr(m, SPARSITY_ATTR)) for m in pruned.values()}
    structure = structures.pop() if len(structures) == 1 else "unstructured"
    if counts is None:
        counts = {n: (int((m.weight.detach() == 0).sum()), m.weight.numel()) for n, m in pruned.items()}
    zeros = sum(counts[n][0] for n in pruned)
    total = sum(counts[n][1] for n in pruned)
    ignore = [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n not in pruned]
    config = classes[fmt](targets=list(pruned), ignore=ignore, global_sparsity=zeros / max(total, 1),
                          sparsity_structure=structure)
    return config.model_dump(mode="json")


@torch.no_grad()
def encode_sparse_weights(state: dict[str, torch.Tensor], pruned: dict[str, nn.Module | None],
                          fmt: str, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """``state`` with each pruned ``<name>.weight`` replaced by its ``<name>.weight.<part>`` tensors.

    ``weights``: the pruned weights by key, when the modules no longer hold them (a streamed run).
    """
    if fmt == DENSE:
        return state
    encode = ENCODERS[fmt]
    state = dict(state)
    for name, module in pruned.items():
        key = f"{name}.weight" if name else "weight"
        weight = weights[key] if weights is not None else module.weight.detach().to("cpu")
        try:
            parts = encode(weight)
        except SparseFormatError as exc:
            raise SaveError(f"pruned layer {name!r} cannot be saved as {fmt}: {exc}. Prune it again, or mark it "
                            f"unstructured (layerwise.algorithms.sparsity.mark_sparse(module, MaskStructure(0, 0))) so it is "
                            f"saved as {BITMASK}") from exc
        state.pop(key)
        state.update({f"{key}.{part}": tensor for part, tensor in parts.items()})
    return state
