"""GPTQ weight quantization, calibrated with data, layer by layer.

Every targeted ``Linear`` (and transformers' ``Conv1D``) gets a forward pre-hook that
collects its inputs for the Hessian ``H = 2/n sum x x^T`` (``n`` counts tokens), kept
in float32 as the upper triangle of ``sum x x^T``, folded in every 256 tokens and
scaled at the end. Layers that read the very same tensor (q/k/v projections,
gate/up) share one such matrix. When the pipeline reports that a piece of the model
was calibrated (``sequential_epoch_end``), the piece's layers are quantized with the
GPTQ solver (:mod:`layerwise.algorithms.quantization.gptq`), their hooks removed and their
matrices freed; ``calibration_end`` quantizes whatever is left (with the ``basic``
pipeline, every layer). :meth:`GPTQModifier.calibration_inputs` tells pipelines
that only these inputs matter, so they may skip or shorten forwards whose outputs
nobody uses.

Schemes, targets, ignore lists and overrides are those of
:class:`~layerwise.plugins.modifiers.quantization.QuantizationModifier`; GPTQ adds
``block_size``, ``dampening_frac``, ``actorder`` and ``gptaq`` (:mod:`.gptaq`: aim at the uncompressed
model's outputs). A layer whose Hessian cannot be
factorised (or that saw no data) is rounded to nearest instead, with a warning
naming it and why. An input holding NaN or inf is left out of the Hessian (it would
poison it) and counted; the layer's warning says how many, and a layer whose every input
was non-finite, or whose own weight is, is a :class:`~layerwise.errors.NonFiniteError`. Per-layer results are in :attr:`GPTQModifier.summary`, in the run's log,
and in ``gptq_summary.json`` next to the saved model.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from layerwise.plugin import (
    AlgorithmFallbackWarning,
    CompressionState,
    ForeignField,
    NonFiniteError,
    RecipeError,
    warn_user,
)
from layerwise.plugin.calibration import Reducer, gptq_solve_flops, is_finite, spread, world_size
from layerwise.plugin.quantization import (
    GPTQError,
    GPTQResult,
    QuantizationArgs,
    global_scales,
    gptq_quantize,
    linear_weight,
    recipe_actorder,
    rtn_quantize,
    set_quantized_weight,
)
from layerwise.plugin.sparsity import pruned_mask

from . import llm_compressor
from .gptaq import AsymmetricTerms
from .hessians import HessianHooks
from .quantization import QuantizationModifier, Unwritten, _in_piece

log = logging.getLogger("layerwise")

SUMMARY_FILE = "gptq_summary.json"

#: GPTQModifier's activation order unless the scheme names one (static costs nothing at inference); only this
#: default, not ``static`` written, yields to the scheme's
DEFAULT_ACTORDER = Unwritten("static")


class GPTQFallbackWarning(AlgorithmFallbackWarning):
    """A layer was rounded to nearest instead of GPTQ-quantized (the message says which and why)."""


@dataclass
class GPTQModifier(HessianHooks, QuantizationModifier):
    """GPTQ-quantize the weights of ``targets`` (minus ``ignore``) with ``scheme``.

    * ``block_size``: columns per lazy-update block (speed only; 128 suits CPUs and GPUs);
    * ``dampening_frac``: added to the Hessian diagonal, as a fraction of its mean;
    * ``actorder``: ``"static"`` (the default; compressed-tensors' ``"weight"``: solve the columns in
      order of decreasing input energy; same checkpoint format, no group index) or ``None``
      (original order). ``"group"`` (``"dynamic"``) is refused, as llm-compressor 0.14 does: its
      group index cannot be saved. A scheme or config group that names an ``actorder`` takes
      precedence over the default; a different, explicitly given one is an error;
    * ``gptaq``: GPTAQ (GPTQ v2): fit each layer to the *uncompressed* model's outputs, so it also
      corrects the error earlier layers left in its inputs (:mod:`.gptaq`); the pipeline then carries
      a second stream of activations (twice the cache) and cuts at blocks; ``gptaq_alpha`` (0.25)
      scales that correction (1: the full least-squares step).
    """

    requires_data: ClassVar[bool] = True
    min_calibration_samples: ClassVar[int] = 16
    hessian_phase: ClassVar[str] = "GPTQ Hessians"
    label: ClassVar[str] = "GPTQ"
    preset_prefix: ClassVar[str | None] = "GPTQ"
    foreign_fields: ClassVar[dict[str, ForeignField]] = llm_compressor.GPTQ

    block_size: int = 128
    dampening_frac: float = 0.01
    actorder: str | None = DEFAULT_ACTORDER
    gptaq: bool = False
    gptaq_alpha: float = 0.25

    block_reason: ClassVar[str] = "with gptaq, compares each block's inputs with the uncompressed model's"

    @property
    def needs_uncompressed_block(self) -> bool:  # type: ignore[override]
        return self.gptaq

    @property
    def needs_reference_inputs(self) -> bool:  # type: ignore[override]
        return self.gptaq

    def __post_init__(self) -> None:
        self._check_solver_fields()
        if self.actorder is not DEFAULT_ACTORDER:
            self.actorder = recipe_actorder(self.actorder, "GPTQModifier.actorder")
        if not isinstance(self.gptaq, bool):
            raise RecipeError(f"GPTQModifier.gptaq must be true or false, got {self.gptaq!r}")
        alpha = self.gptaq_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
            raise RecipeError(f"GPTQModifier.gptaq_alpha must be a number in [0, 1] (0.25 usual), got {alpha!r}")
        super().__post_init__()
        self.actorder = self.args.actorder  # what runs, as plain data: a saved recipe rebuilds the same
        self._asymmetric = AsymmetricTerms()
        #: one record per quantized layer: name, method, loss, seconds, samples, dampening_frac
        self.summary: list[dict[str, Any]] = []
        self._init_hessians()

    def resolve_args(self) -> QuantizationArgs:
        args = super().resolve_args()
        if args.strategy == "block":
            raise RecipeError("GPTQModifier solves column by column: weight strategy 'block' (FP8_BLOCK) is "
                              "round-to-nearest only; use QuantizationModifier")
        scheme_order = recipe_actorder(args.actorder, "GPTQModifier: the scheme's actorder")
        if self.actorder is DEFAULT_ACTORDER:  # the field's default yields to the scheme's choice
            return args.replace(actorder=scheme_order or str(DEFAULT_ACTORDER))
        if scheme_order is not None and scheme_order != self.actorder:
            raise RecipeError(f"GPTQModifier.actorder {self.actorder!r} contradicts the scheme's actorder "
                              f"{scheme_order!r}; give it in one place only (leave GPTQModifier.actorder out, or "
                              f"the config group's weights.actorder)")
        return args.replace(actorder=self.actorder)

    # -- events ------------------------------------------------------------------------
    def on_initialize(self, state: CompressionState) -> None:
        super().on_initialize(state)
        self.summary = []
        self._free_all()

    def on_calibration_start(self, state: CompressionState) -> None:
        self._hook_hessians(state, self._modules)
        self._observe_inputs()
        self.observe_kv_cache()
        if self.gptaq:
            for name, module in self._modules.items():
                if name not in self._done:
                    self.register_hook(module, self._asymmetric.compressed_hook(name), "forward_pre",
                                       with_kwargs=True)

    def reference_hooks(self, modules: list[str]) -> list[torch.utils.hooks.RemovableHandle]:
        """GPTAQ: each layer of ``modules`` still to quantize keeps its input in the uncompressed model."""
        return [module.register_forward_pre_hook(self._asymmetric.original_hook(name), with_kwargs=True)
                for name, module in self._modules.items() if name not in self._done and _in_piece(name, modules)]

    def on_reduce(self, state: CompressionState, reducer: Reducer, modules: list[str] | None) -> None:
        """Sum the Hessians (Gram matrices and token counts), GPTAQ's cross terms, and merge the input
        observers over the ranks."""
        super().on_reduce(state, reducer, modules)
        self._reduce_hessians(reducer, modules)
        if self.gptaq:
            names = sorted(n for n in self._modules if n not in self._done and (modules is None or _in_piece(n, modules)))
            widths = {n: linear_weight(self._modules[n]).shape[-1] for n in names}
            self._asymmetric.reduce(reducer, names, widths, state.execution_device)

    def on_sequential_epoch_end(self, state: CompressionState, modules: list[str]) -> None:
        self._last = None
        self.quantize_modules([name for name in self._modules if name not in self._done and _in_piece(name, modules)],
                              state)
        self.finish_kv_cache(modules)

    def on_calibration_end(self, state: CompressionState) -> None:
        self._last = None
        self.quantize_modules([name for name in self._modules if name not in self._done], state)
        self.finish_kv_cache(None)

    def calibration_inputs(self, modules: list[str]) -> set[str] | None:
        """GPTQ reads only the inputs of its layers still to be quantized (whole forwards while a KV cache is
        calibrated there)."""
        if self._kv is not None and self._kv.pending(modules):
            return None
        return {name for name in self._modules if name not in self._done and _in_piece(name, modules)}

    def remove_hooks(self) -> None:
        """Remove the Hessian hooks and free every Hessian still held (also after an error)."""
        super().remove_hooks()
        self._free_all()
        self._asymmetric.clear()

    def output_files(self) -> dict[str, str]:
        return {SUMMARY_FILE: json.dumps(self.summary, indent=1)} if self.summary else {}

    # -- work --------------------------------------------------------------------------
    def quantize_modules(self, names: list[str], state: CompressionState | None = None) -> None:
        """Quantize layers ``names`` (:meth:`quantize_module` each); with several ranks each rank solves its
        share and every rank applies them all."""
        self.prepare_global_scales(names)  # NVFP4: fixed (and fused) from the weights before any is solved
        if world_size() == 1:
            for group in self._stackable_runs(names):
                solved = self._solve_stacked(group) if len(group) > 1 else [self._solve(group[0])]
                for name, one in zip(group, solved):
                    self._apply(name, self._modules[name], one, state)
            return
        for name, solved in spread(names, self._solve, skip=self._take_hessian):
            self._apply(name, self._modules[name], solved, state)

    @torch.no_grad()
    def quantize_module(self, name: str, module: torch.nn.Module, state: CompressionState | None = None) -> None:
        """GPTQ with the layer's Hessian (round-to-nearest when there is none or it is unusable)."""
        self._apply(name, module, self._solve(name, module), state)

    def _stackable_runs(self, names: list[str]) -> list[list[str]]:
        """``names`` in runs of consecutive layers reading one input (one shared Gram matrix, e.g. q/k/v),
        which one solve can take together (:meth:`GPTQResult.split`); per-tensor scales span a whole
        weight, so those layers stay apart."""
        runs: list[list[str]] = []
        stackable = self.args.strategy in ("channel", "group") and not self.gptaq  # GPTAQ: one target per layer
        for name in names:
            if runs and stackable and self._shares_input(runs[-1][-1], name):
                runs[-1].append(name)
            else:
                runs.append([name])
        return runs

    def _shares_input(self, first: str, second: str) -> bool:
        gram = self._grams.get(first)
        a, b = linear_weight(self._modules[first]), linear_weight(self._modules[second])
        return (gram is not None and gram is self._grams.get(second) and a.shape[1] == b.shape[1]
                and a.dtype == b.dtype and a.device == b.device)

    @torch.no_grad()
    def _solve_stacked(self, names: list[str]) -> list[_Solved]:
        """Layers reading one input, solved as one taller weight (each gets what it would alone); apart
        when their Hessians turn out to differ or the solve fails."""
        taken = [self._take_hessian(names[0])]
        hessian, samples, _ = taken[0]
        for name in names[1:]:  # one matrix kept for all that equal it (the solver never changes it)
            other, rows, lost = self._take_hessian(name)
            same = hessian is not None and other is not None and rows == samples and torch.equal(other, hessian)
            taken.append((hessian if same else other, rows, lost))
        if hessian is None or samples == 0 or any(h is not hessian for h, _, _ in taken[1:]):
            return [self._solve(name, taken=one) for name, one in zip(names, taken)]
        start = time.perf_counter()
        modules = [self._modules[name] for name in names]
        weights = [linear_weight(module) for module in modules]
        for name, weight in zip(names, weights):
            _check_finite_weight(name, weight)
        masks = [pruned_mask(module) for module in modules]
        pruned = None if all(m is None for m in masks) else torch.cat(
            [torch.zeros(w.shape, dtype=torch.bool, device=w.device) if m is None else m for m, w in zip(masks, weights)])
        stacked = torch.cat(weights)
        try:
            with self._accounting.timed(SOLVE_PHASE, gptq_solve_flops(*stacked.shape)):
                result = gptq_quantize(stacked, hessian, self.args, observer=self._observer, block_size=self.block_size,
                                       dampening_frac=self.dampening_frac, scale_dtype=modules[0].weight.dtype,
                                       pruned=pruned)
        except GPTQError:  # each layer then says why it is rounded to nearest
            return [self._solve(name, taken=one) for name, one in zip(names, taken)]
        dropped = [one[2] for one in taken]
        del taken, hessian
        seconds = (time.perf_counter() - start) / len(names)
        parts = result.split([weight.shape[0] for weight in weights])
        return [_Solved(part, None, samples, lost, seconds) for part, lost in zip(parts, dropped)]

    @torch.no_grad()
    def _solve(self, name: str, module: torch.nn.Module | None = None,
               taken: tuple[torch.Tensor | None, int, int] | None = None) -> _Solved:
        """The layer's GPTQ (or round-to-nearest) result, with what its record needs; changes no module.
        ``taken``: its Hessian, token count and dropped inputs when already taken from the bank."""
        module = self._modules[name] if module is None else module
        start = time.perf_counter()
        hessian, samples, dropped = self._take_hessian(name) if taken is None else taken
        weight = linear_weight(module)
        _check_finite_weight(name, weight)
        dtype = module.weight.dtype
        result: GPTQResult | None = None
        reason = None
        pruned = pruned_mask(module)  # a pruning modifier's zeros stay zeros
        extra: dict[str, Any] = {}
        if hessian is None or samples == 0:
            reason = "it saw no calibration data"
        else:
            if self.gptaq:
                weight, extra = self._asymmetric.target(name, weight, hessian, self.gptaq_alpha, self.dampening_frac)
            try:
                with self._accounting.timed(SOLVE_PHASE, gptq_solve_flops(*weight.shape)):
                    result = gptq_quantize(weight, hessian, self.args, observer=self._observer,
                                           block_size=self.block_size, dampening_frac=self.dampening_frac,
                                           scale_dtype=dtype, pruned=pruned, global_scale=self._global_scale(name))
            except GPTQError as exc:
                reason = str(exc)
            del hessian
        if result is None:
            result = rtn_quantize(weight, self.args, observer=self._observer, scale_dtype=dtype,
                                  global_scale=self._global_scale(name))
        return _Solved(result, reason, samples, dropped, time.perf_counter() - start, extra)

    def _global_scale(self, name: str) -> torch.Tensor | None:
        """NVFP4: the layer's global scale (:meth:`prepare_global_scales`; its own weight's when not prepared)."""
        if self.args.float_format != "nvfp4":
            return None
        if name not in self._global_scales:
            self._global_scales[name] = global_scales({name: linear_weight(self._modules[name]).detach()},
                                                      self.args)[name]
        return self._global_scales[name]

    @torch.no_grad()
    def _apply(self, name: str, module: torch.nn.Module, solved: _Solved, state: CompressionState | None) -> None:
        """Store a solved layer on ``module`` and record it (every rank, for every layer)."""
        start = time.perf_counter()
        result = solved.result
        method = "gptq" if solved.fallback is None else "rtn"
        if solved.fallback is not None:
            message = f"GPTQ: layer {name!r} is rounded to nearest instead: {solved.fallback}"
            warn_user(message, GPTQFallbackWarning)
        set_quantized_weight(module, result.weight, result.scale, result.zero_point, self.args, result.g_idx,
                             on_grid=True, global_scale=self._global_scale(name))
        self._global_scales.pop(name, None)
        self.quantize_inputs(name, module)
        self._done.add(name)
        samples, dropped = solved.samples, solved.dropped
        record = {"name": name, "method": method, "loss": None if math.isnan(result.loss) else result.loss,
                  "seconds": round(solved.seconds + time.perf_counter() - start, 4), "tokens": samples,
                  "dampening_frac": None if math.isnan(result.dampening_frac) else result.dampening_frac}
        if dropped:
            record["non_finite_inputs"] = dropped
        record.update(solved.extra)
        if method == "gptq" and result.dampening_frac != self.dampening_frac:
            log.warning("GPTQ: layer %r needed dampening %g (asked %g) to factorise its Hessian",
                        name, result.dampening_frac, self.dampening_frac)
        self.summary.append(record)
        if state is not None:
            state.log.append({"modifier": type(self).__name__, **record})
        log.info("GPTQ %s: %s loss %s, %.3f s, %d samples", name, method,
                 "n/a" if record["loss"] is None else f"{record['loss']:.4g}", record["seconds"], samples)


@dataclass
class _Solved:
    """One layer's solve, as it travels between ranks: the result and what the layer's record needs."""

    result: GPTQResult
    #: why the layer was rounded to nearest instead (``None``: GPTQ)
    fallback: str | None
    samples: int
    dropped: int
    seconds: float
    #: more fields for the layer's record (GPTAQ's)
    extra: dict[str, Any] = field(default_factory=dict)


def _check_finite_weight(name: str, weight: torch.Tensor) -> None:
    """A weight holding NaN/inf cannot be quantized by any method: say so, instead of saving NaN scales."""
    if not is_finite(weight):
        count = int((~torch.isfinite(weight)).sum())
        raise NonFiniteError(f"GPTQ: the weight of layer {name!r} itself holds {count} NaN/inf value(s); neither GPTQ "
                             f"nor round-to-nearest can quantize it. Load a good checkpoint, add {name!r} to "
                             f"ignore, or pass non_finite='skip' to compress() (CLI: --skip-non-finite)")


#: accounting phases (see layerwise.runtime.accounting): the Gram products with their copies, and the solves
HESSIAN_PHASE = GPTQModifier.hessian_phase
SOLVE_PHASE = "GPTQ solves"
