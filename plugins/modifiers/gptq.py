"""GPTQ weight quantization, calibrated with data, layer by layer.

Every targeted ``Linear`` (and transformers' ``Conv1D``) gets a forward pre-hook that
collects its inputs for the Hessian ``H = 2/n sum x x^T`` (``n`` counts tokens), kept
in float32 as the upper triangle of ``sum x x^T``, folded in every 256 tokens and
scaled at the end. Layers that read the very same tensor (q/k/v projections,
gate/up) share one such matrix. When the pipeline reports that a piece of the model
was calibrated (``sequential_epoch_end``), the piece's layers are quantized with the
GPTQ solver (:mod:`layerwise.quantization.gptq`), their hooks removed and their
matrices freed; ``calibration_end`` quantizes whatever is left (with the ``basic``
pipeline, every layer). :meth:`GPTQModifier.calibration_inputs` tells pipelines
that only these inputs matter, so they may skip or shorten forwards whose outputs
nobody uses.

Schemes, targets, ignore lists and overrides are those of
:class:`~layerwise.plugins.modifiers.quantization.QuantizationModifier`; GPTQ adds
``block_size``, ``dampening_frac`` and ``actorder``. A layer whose Hessian cannot be
factorised (or that saw no data) is rounded to nearest instead, with a warning
naming it and why. An input holding NaN or inf is left out of the Hessian (it would
poison it) and counted; the layer's warning says how many, and a layer whose every input
was non-finite, or whose own weight is, is a :class:`~layerwise.errors.NonFiniteError`. Per-layer results are in :attr:`GPTQModifier.summary`, in the run's log,
and in ``gptq_summary.json`` next to the saved model.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from layerwise.accounting import Accounting, gptq_solve_flops, gram_flops
from layerwise.errors import NonFiniteError, RecipeError
from layerwise.finite import NonFiniteSampleWarning, is_finite
from layerwise.quantization.args import ACTORDERS, QuantizationArgs
from layerwise.quantization.gptq import (
    GRAM_STRIP,
    GPTQError,
    GPTQResult,
    add_gram,
    gptq_quantize,
    gram_to_hessian,
    rtn_quantize,
)
from layerwise.quantization.storage import linear_weight, set_quantized_weight
from layerwise.state import CompressionState
from layerwise.user_warnings import warn_user

from .quantization import QuantizationModifier, _in_piece

log = logging.getLogger("layerwise")

SUMMARY_FILE = "gptq_summary.json"
#: GPTQModifier's activation order unless the scheme names one (static costs nothing at inference)
DEFAULT_ACTORDER = "static"


class GPTQFallbackWarning(RuntimeWarning):
    """A layer was rounded to nearest instead of GPTQ-quantized (the message says which and why)."""


@dataclass
class GPTQModifier(QuantizationModifier):
    """GPTQ-quantize the weights of ``targets`` (minus ``ignore``) with ``scheme``.

    * ``block_size``: columns per lazy-update block (speed only; 128 suits CPUs and GPUs);
    * ``dampening_frac``: added to the Hessian diagonal, as a fraction of its mean;
    * ``actorder``: ``"static"`` (the default: solve the columns in order of decreasing
      input energy; same checkpoint format, no group index), ``None`` (original order)
      or ``"group"`` (groups formed in that order; needs a group index, which
      compressed-tensors cannot load back, so such a model stays in memory only).
      A scheme that names an ``actorder`` takes precedence over the default; a
      different, explicitly given one is an error.
    """

    requires_data: ClassVar[bool] = True

    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: str | None = DEFAULT_ACTORDER

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise RecipeError(f"GPTQModifier.block_size must be a positive integer, got {self.block_size!r}")
        if (isinstance(self.dampening_frac, bool) or not isinstance(self.dampening_frac, (int, float))
                or not math.isfinite(self.dampening_frac) or self.dampening_frac < 0):
            raise RecipeError(f"GPTQModifier.dampening_frac must be a number >= 0 (typically 0.01), "
                              f"got {self.dampening_frac!r}")
        if self.actorder not in ACTORDERS:
            raise RecipeError(f"unknown actorder {self.actorder!r}; valid actorders: None, static, group")
        super().__post_init__()
        #: one record per quantized layer: name, method, loss, seconds, samples, dampening_frac
        self.summary: list[dict[str, Any]] = []
        #: per layer, the (possibly shared) Gram matrix of its inputs
        self._grams: dict[str, _SharedGram] = {}
        self._handles: dict[str, torch.utils.hooks.RemovableHandle] = {}
        #: per layer, the calibration inputs left out of its Hessian because they held NaN or inf
        self._non_finite: dict[str, int] = {}
        # the previous hook's input, its float32 copy, and the Gram that took it
        self._last: tuple[torch.Tensor, int, torch.Tensor, _SharedGram] | None = None
        #: where the Hessian and solve time goes (the run's, from calibration_start on)
        self._accounting = Accounting()
        self._gram_flops = _FlopCount()

    def resolve_args(self) -> QuantizationArgs:
        args = super().resolve_args()
        if args.actorder is None or args.actorder == self.actorder:
            return args.replace(actorder=self.actorder) if self.actorder != args.actorder else args
        if self.actorder == DEFAULT_ACTORDER:  # the field's default yields to the scheme's choice
            return args
        raise RecipeError(f"GPTQModifier.actorder {self.actorder!r} contradicts the scheme's actorder "
                          f"{args.actorder!r}; give it in one place only")

    # -- events ------------------------------------------------------------------------
    def on_initialize(self, state: CompressionState) -> None:
        super().on_initialize(state)
        self.summary = []
        self._free_all()

    def on_calibration_start(self, state: CompressionState) -> None:
        accounting = getattr(state, "accounting", None)
        self._accounting = accounting if accounting is not None else Accounting()
        for name, module in self._modules.items():
            if name not in self._done:
                self._handles[name] = self.register_hook(module, self._hessian_hook(name), "forward_pre",
                                                         with_kwargs=True)

    def on_sequential_epoch_end(self, state: CompressionState, modules: list[str]) -> None:
        self._last = None
        for name, module in self._modules.items():
            if name not in self._done and _in_piece(name, modules):
                self.quantize_module(name, module, state)

    def on_calibration_end(self, state: CompressionState) -> None:
        self._last = None
        for name, module in self._modules.items():
            if name not in self._done:
                self.quantize_module(name, module, state)

    def calibration_inputs(self, modules: list[str]) -> set[str]:
        """GPTQ reads only the inputs of its layers still to be quantized."""
        return {name for name in self._modules if name not in self._done and _in_piece(name, modules)}

    def remove_hooks(self) -> None:
        """Remove the Hessian hooks and free every Hessian still held (also after an error)."""
        super().remove_hooks()
        self._handles.clear()
        self._free_all()

    def output_files(self) -> dict[str, str]:
        return {SUMMARY_FILE: json.dumps(self.summary, indent=1)} if self.summary else {}

    # -- calibration -------------------------------------------------------------------
    def _hessian_hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = args[0] if args else kwargs.get("input", next(iter(kwargs.values()), None))
            if not isinstance(x, torch.Tensor) or name in self._done:
                return
            if not is_finite(x):  # one NaN row would make the whole Hessian NaN
                self._non_finite[name] = self._non_finite.get(name, 0) + 1
                return
            with self._hessian_work():
                self._accumulate(name, x)
        return hook

    @contextlib.contextmanager
    def _hessian_work(self):
        """Time a Hessian step into the run's accounting, with the Gram FLOPs it did."""
        start, flops = time.perf_counter(), self._gram_flops.value
        try:
            yield
        finally:
            self._accounting.add(HESSIAN_PHASE, time.perf_counter() - start, self._gram_flops.value - flops)

    @torch.no_grad()
    def _accumulate(self, name: str, x: torch.Tensor) -> None:
        last = self._last
        gram = self._grams.get(name)
        if gram is not None and gram.alone_and_idle() and x.numel() >= FLUSH_ROWS * x.shape[-1]:
            # a layer with its own matrix and a long input: fold it right away, no copy kept
            self._last = None
            gram.fold_now(name, x.detach().reshape(-1, x.shape[-1]).to(torch.float32))
            return
        if last is not None and last[0] is x and last[1] == x._version:
            flat = last[2]  # the same tensor as the previous layer read (q/k/v, gate/up)
        else:
            flat = x.detach().to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            flat = flat.reshape(-1, flat.shape[-1])
        if gram is None and last is not None and last[2] is flat and last[3].joinable(flat):
            gram = last[3]  # first input, and the same one another layer just started with: share
            self._grams[name] = gram
            gram.join(name)
        else:
            if gram is None:
                gram = self._grams[name] = _SharedGram(self._gram_flops)
            gram = gram.read(name, flat, self._grams)
        self._last = (x, x._version, flat, gram)
        gram.fold_confirmed(FLUSH_ROWS)

    def _hessian(self, name: str) -> tuple[torch.Tensor | None, int]:
        """The layer's Hessian ``2/n X^T X`` (``None`` without data) and ``n``; forgets the layer."""
        gram = self._grams.pop(name, None)
        if gram is None:
            return None, 0
        return gram.take(name)

    def _free_all(self) -> None:
        self._grams.clear()
        self._non_finite.clear()
        self._last = None

    # -- work --------------------------------------------------------------------------
    @torch.no_grad()
    def quantize_module(self, name: str, module: torch.nn.Module, state: CompressionState | None = None) -> None:
        """GPTQ with the layer's Hessian (round-to-nearest when there is none or it is unusable)."""
        start = time.perf_counter()
        handle = self._handles.pop(name, None)
        if handle is not None:
            handle.remove()
        with self._hessian_work():
            hessian, samples = self._hessian(name)
        dropped = self._non_finite.pop(name, 0)
        weight = linear_weight(module)
        _check_finite_weight(name, weight)
        dtype = module.weight.dtype
        result: GPTQResult | None = None
        method = "gptq"
        if dropped:
            _warn_dropped(name, dropped, hessian is None or samples == 0)
        if hessian is None or samples == 0:
            reason = "it saw no calibration data"
        else:
            try:
                with self._accounting.timed(SOLVE_PHASE, gptq_solve_flops(*weight.shape)):
                    result = gptq_quantize(weight, hessian, self.args, observer=self._observer,
                                           block_size=self.block_size, dampening_frac=self.dampening_frac,
                                           scale_dtype=dtype)
            except GPTQError as exc:
                reason = str(exc)
            del hessian
        if result is None:
            method = "rtn"
            message = f"GPTQ: layer {name!r} is rounded to nearest instead: {reason}"
            warn_user(message, GPTQFallbackWarning)
            result = rtn_quantize(weight, self.args, observer=self._observer, scale_dtype=dtype)
        set_quantized_weight(module, result.weight, result.scale, result.zero_point, self.args, result.g_idx)
        self._done.add(name)
        record = {"name": name, "method": method, "loss": None if math.isnan(result.loss) else result.loss,
                  "seconds": round(time.perf_counter() - start, 4), "samples": samples,
                  "dampening_frac": None if math.isnan(result.dampening_frac) else result.dampening_frac}
        if dropped:
            record["non_finite_inputs"] = dropped
        if method == "gptq" and result.dampening_frac != self.dampening_frac:
            log.warning("GPTQ: layer %r needed dampening %g (asked %g) to factorise its Hessian",
                        name, result.dampening_frac, self.dampening_frac)
        self.summary.append(record)
        if state is not None:
            state.log.append({"modifier": type(self).__name__, **record})
        log.info("GPTQ %s: %s loss %s, %.3f s, %d samples", name, method,
                 "n/a" if record["loss"] is None else f"{record['loss']:.4g}", record["seconds"], samples)


def _check_finite_weight(name: str, weight: torch.Tensor) -> None:
    """A weight holding NaN/inf cannot be quantized by any method: say so, instead of saving NaN scales."""
    if not is_finite(weight):
        count = int((~torch.isfinite(weight)).sum())
        raise NonFiniteError(f"GPTQ: the weight of layer {name!r} itself holds {count} NaN/inf value(s); neither GPTQ "
                             f"nor round-to-nearest can quantize it. Load a good checkpoint, add {name!r} to "
                             f"ignore, or pass non_finite='skip' to compress() (CLI: --skip-non-finite)")


def _warn_dropped(name: str, dropped: int, none_left: bool) -> None:
    """Non-finite calibration inputs of one layer: a warning, or an error when no finite one was left."""
    if none_left:
        raise NonFiniteError(f"GPTQ: every calibration input of layer {name!r} ({dropped}) held NaN or inf, so "
                             f"there is no data to calibrate it with; the model's forward is not finite on this "
                             f"data (a non-finite weight upstream, or float16 overflow: load it in bfloat16 or "
                             f"float32)")
    message = (f"GPTQ: layer {name!r}: {dropped} calibration input(s) held NaN or inf and were left out of its "
               f"Hessian")
    warn_user(message, NonFiniteSampleWarning)


#: accounting phases (see layerwise.accounting): the Gram products with their copies, and the solves
HESSIAN_PHASE = "GPTQ Hessians"
SOLVE_PHASE = "GPTQ solves"


class _FlopCount:
    """FLOPs of the Gram products so far (shared by a modifier's Gram matrices)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


def _add_gram(gram: torch.Tensor, x: torch.Tensor, flops: _FlopCount) -> None:
    add_gram(gram, x)
    flops.value += gram_flops(x.shape[0], x.shape[1], GRAM_STRIP)


#: inputs are folded into a Gram matrix once this many rows (tokens) are waiting: products this
#: tall run near the machine's peak, and the matrix is read and written once per fold, not per batch
FLUSH_ROWS = 256


class _SharedGram:
    """The Gram matrix ``X^T X`` (upper triangle) of the inputs one or more layers read.

    Layers that read the very same tensors (q/k/v projections, gate/up) share one
    instance: one product, one matrix. Each member's position counts the inputs it
    has read; an input is folded into the matrix only once every member read it, so
    a member whose inputs stop matching (never seen in practice) splits off with an
    exact copy of its own history.
    """

    __slots__ = ("first", "flops", "folded", "gram", "pending", "positions", "samples")

    def __init__(self, flops: _FlopCount) -> None:
        self.flops = flops
        self.first: torch.Tensor | None = None          # the only input so far (``None`` once there are two)
        self.gram: torch.Tensor | None = None
        self.samples = 0                                # rows folded into ``gram``
        self.pending: list[torch.Tensor] = []           # inputs not folded yet, in order
        self.folded = 0                                 # inputs folded (index of pending[0])
        self.positions: dict[str, int] = {}             # member -> inputs it has read

    def joinable(self, flat: torch.Tensor) -> bool:
        """Has this Gram seen exactly one input, ``flat`` (folded already or not)?"""
        return self.folded + len(self.pending) == 1 and self.first is flat

    def join(self, name: str) -> None:
        """A new member whose first input is this Gram's only one (see :meth:`joinable`)."""
        self.positions[name] = 1

    def read(self, name: str, flat: torch.Tensor, owners: dict[str, _SharedGram]) -> _SharedGram:
        """Member ``name`` read ``flat``; returns the Gram that holds its history now."""
        position = self.positions.get(name, 0)
        end = self.folded + len(self.pending)
        if position == end:
            self.first = flat if end == 0 else None
            self.pending.append(flat)
        elif self.pending[position - self.folded] is not flat:
            return self._split(name, position, flat, owners)
        self.positions[name] = position + 1
        return self

    def _split(self, name: str, position: int, flat: torch.Tensor, owners: dict[str, _SharedGram]) -> _SharedGram:
        mine = _SharedGram(self.flops)
        mine.gram = None if self.gram is None else self.gram.clone()
        mine.samples, mine.folded = self.samples, self.folded
        mine.pending = [*self.pending[:position - self.folded], flat]
        mine.positions[name] = position + 1
        del self.positions[name]
        owners[name] = mine
        return mine

    def alone_and_idle(self) -> bool:
        """One member, nothing waiting, and past its first input (when another layer could have joined)."""
        return len(self.positions) == 1 and not self.pending and self.folded > 0

    def fold_now(self, name: str, x: torch.Tensor) -> None:
        """Fold the sole member's next input directly."""
        _add_gram(self.gram, x, self.flops)
        self.samples += x.shape[0]
        self.folded += 1
        self.positions[name] += 1

    def fold_confirmed(self, min_rows: int) -> None:
        """Fold the inputs every member has read, once they add up to ``min_rows`` rows."""
        ready = min(self.positions.values()) - self.folded
        if ready and sum(t.shape[0] for t in self.pending[:ready]) >= min_rows:
            self._fold(ready)

    def _fold(self, count: int) -> None:
        chunk = self.pending[:count]
        x = chunk[0] if len(chunk) == 1 else torch.cat(chunk)
        if self.gram is None:
            self.gram = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
        _add_gram(self.gram, x, self.flops)
        self.samples += x.shape[0]
        del self.pending[:count]
        self.folded += count

    def take(self, name: str) -> tuple[torch.Tensor | None, int]:
        """Member ``name``'s Hessian and row count; it leaves the group."""
        position = self.positions.pop(name)
        others_caught_up = all(p >= position for p in self.positions.values())
        if others_caught_up:  # fold for everyone: the next member reuses the work
            if position > self.folded:
                self._fold(position - self.folded)
            if self.gram is None:
                return None, 0
            return gram_to_hessian(self.gram, self.samples), self.samples
        mine = self.gram.clone() if self.gram is not None else None
        rows = self.samples
        chunk = self.pending[:position - self.folded]
        if chunk:
            x = torch.cat(chunk)
            mine = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device) if mine is None else mine
            _add_gram(mine, x, self.flops)
            rows += x.shape[0]
        return (None, 0) if mine is None else (gram_to_hessian(mine, rows), rows)
