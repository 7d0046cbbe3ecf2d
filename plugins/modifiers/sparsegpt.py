"""SparseGPT pruning, calibrated with data, layer by layer.

Every targeted layer's inputs are folded into its Hessian exactly as for GPTQ (shared
float32 Gram matrices, :mod:`.hessians`); when the pipeline finishes a piece, its layers
are pruned with the SparseGPT solver (:mod:`layerwise.algorithms.sparsity.sparsegpt`), so the next
piece calibrates on the outputs of the already pruned model (error propagation). As in the paper,
the layers of one block are calibrated on the block's unpruned inputs by default (the pipeline cuts
at blocks); ``true_sequential=True`` calibrates each layer on the outputs of the layers pruned
before it (a cut at layers). A layer
without data or with a Hessian that cannot be factorised is magnitude-pruned, with a
warning naming it. Per-layer results go to :attr:`SparseGPTModifier.summary` and
``sparsegpt_summary.json`` next to the saved model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from layerwise.plugin import CompressionState, ForeignField
from layerwise.plugin.calibration import HessianError, Reducer
from layerwise.plugin.sparsity import sparsegpt_prune

from . import llm_compressor
from .hessians import HessianHooks
from .pruning import PruningModifier

#: accounting phase of the solves (the Gram products are timed under SparseGPTModifier.hessian_phase)
SOLVE_PHASE = "SparseGPT solves"


@dataclass
class SparseGPTModifier(HessianHooks, PruningModifier):
    """Prune ``targets`` (minus ``ignore``) to ``sparsity`` in ``mask_structure`` with SparseGPT.

    * ``block_size``: columns per block: the unstructured mask is chosen per block, from
      the weights as updated by the blocks before (128, as in the paper);
    * ``dampening_frac``: added to the Hessian diagonal, as a fraction of its mean;
    * ``true_sequential``: ``False`` (default, the paper's): every layer of a block sees the
      block's unpruned inputs; ``True``: each layer sees the inputs of the model pruned so far
      (a cut at layers: the later layers of a block compensate the earlier ones' pruning).
    """

    summary_file: ClassVar[str] = "sparsegpt_summary.json"
    foreign_fields: ClassVar[dict[str, ForeignField]] = llm_compressor.SPARSEGPT
    hessian_phase: ClassVar[str] = "SparseGPT Hessians"
    label: ClassVar[str] = "SparseGPT"

    block_size: int = 128
    dampening_frac: float = 0.01

    block_reason: ClassVar[str] = ("calibrates a block's layers on its unpruned inputs, as in the paper "
                                   "(true_sequential=True cuts at layers)")

    def __post_init__(self) -> None:
        self._check_solver_fields()
        super().__post_init__()
        self._init_hessians()

    def on_initialize(self, state: CompressionState) -> None:
        super().on_initialize(state)
        self._free_all()

    def on_calibration_start(self, state: CompressionState) -> None:
        super().on_calibration_start(state)  # OWL's dense pass first, without these hooks
        self._hook_hessians(state, self._modules)

    def on_reduce(self, state: CompressionState, reducer: Reducer, modules: list[str] | None) -> None:
        """Sum the Hessians (Gram matrices and token counts) over the ranks."""
        self._reduce_hessians(reducer, modules)

    def skip_layer(self, name: str) -> None:
        """Another rank prunes ``name``: take (and drop) its Hessian, so the bank's bookkeeping stays as everywhere."""
        self._take_hessian(name)

    def on_sequential_epoch_end(self, state: CompressionState, modules: list[str]) -> None:
        self._last = None
        super().on_sequential_epoch_end(state, modules)

    def on_calibration_end(self, state: CompressionState) -> None:
        self._last = None
        super().on_calibration_end(state)

    def remove_hooks(self) -> None:
        """Remove the Hessian hooks and free every Hessian still held (also after an error)."""
        super().remove_hooks()
        self._free_all()

    def solve(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, Any]]:
        hessian, samples, dropped = self._take_hessian(name)
        extra = {"tokens": samples, **({"non_finite_inputs": dropped} if dropped else {})}
        if hessian is None or samples == 0:
            return self.fallback(name, "it saw no calibration data", extra)
        columns = weight.shape[1]
        try:
            with self._accounting.timed(SOLVE_PHASE, sparsegpt_solve_flops(weight.shape[0], columns)):
                result = sparsegpt_prune(weight, hessian, self.structure, self.sparsity_for(name),
                                         block_size=self.block_size, dampening_frac=self.dampening_frac)
        except HessianError as exc:
            return self.fallback(name, str(exc), extra)
        return result.weight, {"method": "sparsegpt", "loss": result.loss,
                               "dampening_frac": result.dampening_frac, **extra}


def sparsegpt_solve_flops(rows: int, columns: int) -> float:
    """FLOPs of one solve: the factorisation (~columns^3) and the column sweep's updates (~rows*columns^2)."""
    return float(columns) ** 3 + 2.0 * rows * float(columns) ** 2
