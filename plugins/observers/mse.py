"""The MSE observer: the clipping range that minimises the quantization error, searched on a grid.

Clipping the range below min-max trades a few large values' error for a finer step on all the
others. For each shrink factor ``p`` in ``1, 0.99, ..., 0.2`` (81 points) the range ``p * (min, max)``
is quantized and the mean squared error measured; the best ``p`` is kept per qparam group (per
channel, group, block or tensor; per MX or NVFP4 block). ``p = 1`` is min-max's range, so no group ends
worse than min-max. NVFP4 block scales are relative to the tensor's global scale: it is computed first, from
the whole weight as min-max computes it (or shared by fused projections), and held fixed while each block's
scale is searched. For static activations the best range of each batch is averaged over the batches (no
batch is stored); ranks of a distributed run average theirs, weighted by their batch counts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from layerwise.plugin.quantization import (
    Observer,
    compute_qparams,
    expand_qparams,
    fake_quantize,
    weight_global_scale,
)

#: shrink factors tried, from no clipping down to 20 % of the range
SHRINKS = torch.linspace(1.0, 0.2, 81)


class MSEObserver(Observer):
    """Range per qparam group minimising the mean squared quantization error."""

    def reduce_weight(self, weight: Tensor, global_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """NVFP4 searches each block's scale relative to the tensor's ``global_scale`` (the one it is stored
        with: shared by fused projections; default the weight's own), which the search leaves as it is."""
        w = weight.detach().to(torch.float32)
        low, high = super().reduce_weight(w)
        if self.args.float_format == "nvfp4" and global_scale is None:
            global_scale = weight_global_scale(w, self.args)
        return self._search(w, low, high, lambda s, z: expand_qparams(w, s, z, self.args), per_group=True,
                            global_scale=global_scale)

    def reduce_activation(self, x: Tensor) -> tuple[Tensor, Tensor]:
        values = x.detach().to(torch.float32)
        low, high = super().reduce_activation(values)
        if self.args.strategy == "tensor_group":  # NVFP4 inputs: the global range, no clipping searched
            return low, high
        return self._search(values, low, high, lambda s, z: (s, z), per_group=False)

    def combine(self, low: Tensor, high: Tensor) -> tuple[Tensor, Tensor]:
        n = self.batches  # running mean of the per-batch best ranges
        return (self.min_vals * n + low) / (n + 1), (self.max_vals * n + high) / (n + 1)

    def merge(self, states: list[tuple[Tensor, Tensor, int]]) -> tuple[Tensor, Tensor]:
        """Several ranks: each holds the mean of its batches' best ranges, so their mean weighted by batch
        counts is the mean over every batch (exact, up to rounding)."""
        total = sum(n for _, _, n in states)
        low = sum(lo * (n / total) for lo, _, n in states)
        high = sum(hi * (n / total) for _, hi, n in states)
        return low, high

    @torch.no_grad()
    def _search(self, values: Tensor, low: Tensor, high: Tensor, expand, per_group: bool,
                global_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
        best_err = torch.full_like(low, float("inf"))
        best_low, best_high = low.clone(), high.clone()
        for p in SHRINKS.tolist():
            scale, zero = compute_qparams(low * p, high * p, self.args, global_scale)
            s, z = expand(scale, zero)
            err = (fake_quantize(values, s, z, self.args) - values).pow(2)
            err = _per_group(err, self.args, low.shape) if per_group else err.mean().reshape(low.shape)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_low = torch.where(better, low * p, best_low)
            best_high = torch.where(better, high * p, best_high)
        return best_low, best_high


def _per_group(err: Tensor, args, shape: torch.Size) -> Tensor:
    """Elementwise errors of an ``(out, in)`` weight summed per qparam group (the shape of ``low``)."""
    if args.strategy == "tensor":
        return err.mean().reshape(shape)
    if args.strategy == "channel":
        return err.mean(dim=1, keepdim=True)
    if args.strategy in ("group", "tensor_group"):  # integer groups; MX and NVFP4 blocks
        return err.reshape(err.shape[0], -1, args.group_size).mean(dim=-1)
    rows, cols = args.block_structure
    padded = torch.nn.functional.pad(err, (0, -err.shape[1] % cols, 0, -err.shape[0] % rows))
    return padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // cols, cols).mean(dim=(1, 3))
