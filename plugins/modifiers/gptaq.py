"""GPTAQ's asymmetric term: what GPTQ needs to aim at the *uncompressed* model's outputs.

Plain GPTQ fits each layer's quantized weight ``Q`` to its own weight ``W`` on the inputs of the model
compressed so far, ``X~``: it minimises ``||W X~ - Q X~||``. GPTAQ (GPTQ v2, Li et al., ICML 2025) aims at
what the uncompressed model computes, ``W X``, with ``X`` the layer's inputs there: it minimises
``||W X - Q X~||``, so a layer also corrects the error earlier layers left in its inputs.

That objective is ``||W* X~ - Q X~||`` plus a constant, where ``W* = W X X~^T (X~ X~^T)^-1
= W + W P H^-1``, with ``H = X~ X~^T`` (GPTQ's Hessian) and ``P = (X - X~) X~^T``: the part of the
target that ``X~`` can reach. So GPTQ run on ``W*`` with the usual ``H`` solves it, column by column,
exactly as it solves its own objective. ``alpha`` scales the step from ``W`` towards ``W*`` (1: all
the way; GPTQModel's default, 0.25, is layerwise's too: ``P`` comes from a few hundred thousand tokens
and a full step overfits them).

:class:`AsymmetricTerms` keeps, per layer, the uncompressed model's input of the current batch (seen
by a reference hook) until the compressed model's input of the same batch arrives, then folds
``(X - X~)^T X~`` into the layer's ``P``; layers reading one input (q/k/v, gate/up) share the products.
"""

from __future__ import annotations

from typing import Any

import torch

from layerwise.plugin.calibration import Reducer, is_finite

from .hessians import layer_input, read_last


class AsymmetricTerms:
    """Per layer ``P = sum over tokens (x - x~) x~^T`` and its token count."""

    def __init__(self) -> None:
        self.cross: dict[str, tuple[torch.Tensor, int]] = {}
        #: the uncompressed model's input of the batch in flight, per layer (shared by layers reading one)
        self._original: dict[str, torch.Tensor] = {}
        self._last_original: tuple[torch.Tensor, int, torch.Tensor] | None = None
        self._last_product: tuple[torch.Tensor, int, torch.Tensor, torch.Tensor] | None = None

    def clear(self) -> None:
        self.cross.clear()
        self._original.clear()
        self._last_original = self._last_product = None

    def original_hook(self, name: str):
        """A forward pre-hook for the reference run: keep this batch's input of layer ``name``."""
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = layer_input(args, kwargs)
            if not isinstance(x, torch.Tensor):
                return
            if read_last(self._last_original, x):
                flat = self._last_original[2]  # type: ignore[index]
            else:
                flat = x.detach().to(torch.float32, copy=True).reshape(-1, x.shape[-1])
                self._last_original = (x, x._version, flat)
            self._original[name] = flat
        return hook

    def compressed_hook(self, name: str):
        """A forward pre-hook for the observed run: fold ``(x - x~)^T x~`` of this batch into ``P``."""
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            original = self._original.pop(name, None)
            x = layer_input(args, kwargs)
            if original is None or not isinstance(x, torch.Tensor):
                return
            self._last_original = None  # the next batch's reference run starts afresh
            product = self._product(x, original)
            if product is None:
                return
            total, rows = self.cross.get(name, (None, 0))
            self.cross[name] = (product.clone() if total is None else total.add_(product),
                                rows + original.shape[0])
        return hook

    @torch.no_grad()
    def _product(self, x: torch.Tensor, original: torch.Tensor) -> torch.Tensor | None:
        last = self._last_product
        if last is not None and last[0] is x and last[1] == x._version and last[2] is original:
            return last[3]
        compressed = x.detach().to(torch.float32).reshape(-1, x.shape[-1])
        if compressed.shape != original.shape or not is_finite(compressed):
            return None  # a batch the two streams do not share token for token, or poisoned: left out
        product = (original - compressed).T @ compressed
        self._last_product = (x, x._version, original, product)
        return product

    def reduce(self, reducer: Reducer, names: list[str], width: dict[str, int], device: torch.device) -> None:
        """Sum ``P`` and its token counts over the ranks (a rank without data adds zeros)."""
        for name in names:
            total, rows = self.cross.get(name, (None, 0))
            if total is None:
                total = torch.zeros(width[name], width[name], dtype=torch.float32, device=device)
            reducer.sum(total)
            rows = int(reducer.count(rows))
            if rows:
                self.cross[name] = (total, rows)
            else:
                self.cross.pop(name, None)

    @torch.no_grad()
    def target(self, name: str, weight: torch.Tensor, hessian: torch.Tensor, alpha: float,
               dampening_frac: float) -> tuple[torch.Tensor, dict[str, Any]]:
        """``W + alpha W P H^-1`` (``H`` damped as GPTQ damps it) for layer ``name``, and what its record
        says; ``W`` itself when there is no ``P`` or ``H`` cannot be factorised (GPTQ then says why)."""
        total, rows = self.cross.pop(name, (None, 0))
        if total is None or rows == 0:
            return weight, {"gptaq": "no reference inputs"}
        cross = total.to(hessian.device) * (2.0 / rows)  # H is 2/n X~ X~^T: P on the same scale
        damped = hessian.clone()
        damped.diagonal().add_(dampening_frac * float(hessian.diagonal().mean()))
        factor, info = torch.linalg.cholesky_ex(damped)
        if int(info):
            return weight, {"gptaq": "Hessian not factorised"}
        w = weight.to(torch.float32)
        step = torch.cholesky_solve((w @ cross).T, factor).T  # W P H^-1 (H symmetric)
        shift = float(step.norm() / w.norm().clamp_min(1e-12))
        return (w + alpha * step).to(weight.dtype), {"gptaq_shift": round(alpha * shift, 6)}
