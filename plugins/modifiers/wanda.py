"""Wanda pruning: weight magnitude times input norm, no second-order solve.

A weight's importance is ``|W[r, j]| * ||X_j||_2``, where ``X_j`` is input column ``j``
over every calibration token; each output row keeps its most important weights
(``mask_structure`` ``"0:0"``: exactly ``round(sparsity * in)`` pruned per row; ``N:M``:
N per run of M). Data-light: a pre-hook keeps one float32 sum of squares per input
column (summed once for layers reading one tensor), nothing else, and nothing is updated
after pruning. A layer that saw no data is magnitude-pruned with a warning. Each block's
layers are scored on the block's unpruned inputs (:attr:`needs_uncompressed_block`: the blocks
cut, observe, prune, run again), as in the Wanda paper; it still reads only its layers' inputs
(:meth:`calibration_inputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from layerwise.plugin import CompressionState, ForeignField
from layerwise.plugin.calibration import Reducer, is_finite
from layerwise.plugin.quantization import linear_weight
from layerwise.plugin.sparsity import score_mask

from . import llm_compressor
from .hessians import _warn_dropped, layer_input, read_last
from .pruning import PruningModifier
from .quantization import _in_piece


@dataclass
class WandaModifier(PruningModifier):
    """Prune ``targets`` (minus ``ignore``) to ``sparsity`` by ``|W| x ||X||`` per output row.

    ``true_sequential``: score each layer on the inputs of the model pruned so far (one forward
    per piece, 1.4x-1.9x faster) instead of on its block's unpruned inputs (the default, the
    paper's): Wanda compensates nothing, so scoring o_proj on a pruned v_proj's outputs costs
    quality (MiniLM cosine 0.8405 instead of 0.8432).
    """

    summary_file: ClassVar[str] = "wanda_summary.json"
    foreign_fields: ClassVar[dict[str, ForeignField]] = llm_compressor.PRUNING

    def __post_init__(self) -> None:
        super().__post_init__()
        #: per layer: the sum over tokens of each input column's square, and the token count
        self._norms: dict[str, tuple[torch.Tensor, int]] = {}
        self._non_finite: dict[str, int] = {}
        #: the input the last hooked layer read (unchanged since: its version), with its column sums
        self._last_input: tuple[torch.Tensor, int, torch.Tensor | None] | None = None

    def on_initialize(self, state: CompressionState) -> None:
        super().on_initialize(state)
        self._norms, self._non_finite = {}, {}

    def on_calibration_start(self, state: CompressionState) -> None:
        super().on_calibration_start(state)  # OWL's dense pass first, without these hooks
        for name, module in self._modules.items():
            if name not in self._done:
                self.register_hook(module, self._norm_hook(name), "forward_pre", with_kwargs=True)

    def remove_hooks(self) -> None:
        super().remove_hooks()
        self._norms.clear()
        self._last_input = None

    def on_reduce(self, state: CompressionState, reducer: Reducer, modules: list[str] | None) -> None:
        """The input columns' sums of squares, their token counts and the non-finite counts add up over the ranks."""
        for name, module in self._modules.items():
            if name in self._done or (modules is not None and not _in_piece(name, modules)):
                continue
            total, count = self._norms.get(name, (None, 0))
            if total is None:
                total = torch.zeros(linear_weight(module).shape[-1], dtype=torch.float32,
                                    device=state.execution_device)
            reducer.sum(total)
            count = int(reducer.count(count))
            dropped = int(reducer.count(self._non_finite.get(name, 0)))
            if count:
                self._norms[name] = (total, count)
            else:
                self._norms.pop(name, None)
            if dropped:
                self._non_finite[name] = dropped

    def skip_layer(self, name: str) -> None:
        """Another rank prunes ``name``: drop its statistics (an input count that is all non-finite still raises)."""
        _, samples = self._norms.pop(name, (None, 0))
        dropped = self._non_finite.pop(name, 0)
        if dropped and samples == 0:
            _warn_dropped("Wanda", name, dropped, True, "input norms")

    def _norm_hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = layer_input(args, kwargs)
            if not isinstance(x, torch.Tensor) or name in self._done:
                return
            squares = self._column_squares(x)
            if squares is None:
                self._non_finite[name] = self._non_finite.get(name, 0) + 1
                return
            total, count = self._norms.get(name, (None, 0))
            # a copy to start from: the same sums may serve the next layer reading this input
            self._norms[name] = (squares.clone() if total is None else total.add_(squares),
                                 count + x.numel() // x.shape[-1])
        return hook

    def _column_squares(self, x: torch.Tensor) -> torch.Tensor | None:
        """Each input column's sum of squares over the rows of ``x`` (``None`` when not finite), computed
        once for layers reading the same tensor one after another (q/k/v, gate/up)."""
        if read_last(self._last_input, x):
            return self._last_input[2]  # type: ignore[index]
        flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float32)
        # a plain sum over rows: 3.5-5.7x faster on the CPU than vector_norm(dim=0) (strided)
        squares = flat.square().sum(0)
        # NaN/inf in the input (or a square overflowing float32) shows in the column sums: checking
        # them is as strict as checking the input, on a vector instead of a matrix
        result = squares if is_finite(squares) else None
        self._last_input = (x, x._version, result)
        return result

    def solve(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, Any]]:
        total, samples = self._norms.pop(name, (None, 0))
        dropped = self._non_finite.pop(name, 0)
        if dropped:  # a warning, or an error when no finite input was left
            _warn_dropped("Wanda", name, dropped, samples == 0, "input norms")
        extra = {"tokens": samples, **({"non_finite_inputs": dropped} if dropped else {})}
        if total is None or samples == 0:
            return self.fallback(name, "it saw no calibration data", extra)
        score = weight.abs() * total.to(weight.device).sqrt().unsqueeze(0)
        mask = score_mask(score, self.structure, self.sparsity_for(name))
        return weight.masked_fill(mask, 0.0), {"method": "wanda", **extra}
