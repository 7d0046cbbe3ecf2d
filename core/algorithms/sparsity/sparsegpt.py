"""The SparseGPT solver: prune a weight column by column, pushing each pruned weight's loss onto the rest.

Pure tensor math, no modules. For a linear layer with Hessian ``H = 2 X X^T / n`` the
cost of zeroing weight ``w[r, j]`` once the columns before ``j`` are settled is
``w[r, j]^2 / [H^-1]_jj``-like: with ``U`` the upper Cholesky factor of the (dampened)
``H^-1``, the solver sweeps the columns in order, zeroes the pruned entries of column
``j``, and updates the later columns of the row by ``-(w - q) / U[j, j] * U[j, j+1:]``:
the optimal (OBS) compensation for a fixed mask, the same column sweep as GPTQ with
"round to zero where pruned" instead of "round to the grid".

The mask is chosen as the sweep goes (adaptive mask selection), from the weights as
already updated, by the score ``w^2 / U[j, j]^2``:

* unstructured (``"0:0"``): at the start of each block of ``block_size`` columns, exactly
  ``round(sparsity * rows * width)`` entries of the block with the lowest scores, over all
  rows (the comparison group of the SparseGPT paper);
* ``N:M``: at the start of each run of ``M`` columns, the ``N`` lowest scores of each row.

With an identity Hessian nothing is compensated and the result is magnitude pruning
(over each block, or each run of ``M``); a test checks it, and one checks the sweep
against a plain float64 column-by-column reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from layerwise.algorithms.hessian import HessianError, inverse_hessian_factor, single_thread
from layerwise.algorithms.sparsity.masks import MaskStructure, pruned_count

__all__ = ["SparseGPTResult", "sparsegpt_prune"]

#: columns whose rank-1 updates are applied one by one inside a block; then one product for the rest
_SUB_BLOCK = 16


@dataclass
class SparseGPTResult:
    """A pruned weight and how it went."""

    #: ``(out, in)`` float32, exact zeros where pruned
    weight: Tensor
    #: ``True`` where pruned
    mask: Tensor
    #: the solver's objective: half the sum of ``((w - q) / U[j, j])**2`` over every pruned entry
    loss: float
    #: the dampening fraction finally used (larger than asked after a failed factorisation)
    dampening_frac: float


@torch.no_grad()
def sparsegpt_prune(weight: Tensor, hessian: Tensor, structure: MaskStructure, sparsity: float,
                    block_size: int = 128, dampening_frac: float = 0.01) -> SparseGPTResult:
    """Prune a ``(out, in)`` weight to ``sparsity`` (or ``structure``'s N:M) given its layer's Hessian.

    Raises :class:`~layerwise.algorithms.hessian.HessianError` when the Hessian has non-finite entries or
    cannot be factorised; the caller decides what to do (magnitude pruning, usually).
    ``hessian`` is not modified.
    """
    columns = weight.shape[1]
    if tuple(hessian.shape) != (columns, columns):
        raise ValueError(f"the Hessian has shape {tuple(hessian.shape)}, the weight has {columns} input columns")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    structure.check_columns(columns, "(this weight)")
    H = hessian.detach().to(torch.float32)
    low, high = torch.aminmax(H)
    if not (math.isfinite(low.item()) and math.isfinite(high.item())):
        raise HessianError("the Hessian has non-finite entries (its inputs held NaN/inf, or overflowed float32)")
    W = weight.detach().to(device=H.device, dtype=torch.float32).clone()
    dead = torch.diagonal(H) == 0
    W[:, dead] = 0.0  # inputs that were always 0: the weights reading them do nothing, prune them first
    # inverse_hessian_factor takes H in reverse order and overwrites it: flip makes the copy
    reversed_h = H.flip(0, 1)
    reversed_h.diagonal()[dead.flip(0)] = 1.0
    U, used_frac = inverse_hessian_factor(reversed_h, dampening_frac)
    del reversed_h
    if structure.m:  # N:M runs must not straddle blocks: a block holds whole runs
        block_size = max(structure.m, block_size // structure.m * structure.m)

    Wt = W.t().contiguous()  # rows are input columns: the per-column work touches contiguous memory
    del W
    pruned_t = torch.zeros_like(Wt, dtype=torch.bool)
    loss = torch.zeros((), dtype=torch.float64, device=Wt.device)
    for i1 in range(0, columns, block_size):
        i2 = min(i1 + block_size, columns)
        W1, U1 = Wt[i1:i2], U[i1:i2, i1:i2]
        d = torch.diagonal(U1).unsqueeze(1)
        M1 = pruned_t[i1:i2]
        if structure.unstructured:
            _select_block(W1, d, sparsity, M1)
        E1 = _sweep_block(W1, U1 / d, d, M1, structure)
        E1.div_(d)
        loss += E1.square().sum(dtype=torch.float64) / 2
        if i2 < columns:  # every later column gets this block's compensation in one product
            Wt[i2:].addmm_(U[i1:i2, i2:].t(), E1, alpha=-1.0)
    return SparseGPTResult(weight=Wt.t().contiguous(), mask=pruned_t.t().contiguous(), loss=float(loss),
                           dampening_frac=used_frac)


def _select_block(W1: Tensor, d: Tensor, sparsity: float, out: Tensor) -> None:
    """Unstructured: mark the block's ``round(sparsity * numel)`` lowest ``w^2 / d^2`` in ``out``."""
    k = pruned_count(W1.numel(), sparsity)
    if k:
        score = (W1 / d).square_().reshape(-1)
        out.view(-1)[torch.topk(score, k, largest=False, sorted=False).indices] = True


def _sweep_block(W1: Tensor, V1: Tensor, d: Tensor, M1: Tensor, structure: MaskStructure) -> Tensor:
    """Zero the pruned entries column by column inside a block; returns the raw errors ``w - q``.

    ``W1`` (``(width, out)``, updated in place and left holding the pruned values), ``V1`` the
    block's factor with rows divided by their diagonal ``d``, ``M1`` the block's mask (filled
    here for N:M, at the start of each run, by the score ``w^2 / d^2`` of the updated weights).
    """
    count = W1.shape[0]
    E1 = torch.zeros_like(W1)
    n, m = structure.n, structure.m
    with single_thread():  # many tiny ops: a second thread only adds synchronisation
        for j1 in range(0, count, _SUB_BLOCK):
            j2 = min(j1 + _SUB_BLOCK, count)
            for i in range(j1, j2):
                if m and i % m == 0:  # a run's first column: choose its N of M from the weights as updated
                    run = (W1[i:i + m] / d[i:i + m]).square_()
                    drop = torch.topk(run, n, dim=0, largest=False, sorted=False).indices
                    M1[i:i + m].scatter_(0, drop, True)
                w, e = W1[i], E1[i]
                torch.mul(w, M1[i], out=e)  # the pruned entries' values are their errors
                w.sub_(e)
                if i + 1 < j2:
                    W1[i + 1:j2].addr_(V1[i][i + 1:j2], e, alpha=-1.0)
            if j2 < count:
                W1[j2:].addmm_(V1[j1:j2, j2:].t(), E1[j1:j2], alpha=-1.0)
    return E1
