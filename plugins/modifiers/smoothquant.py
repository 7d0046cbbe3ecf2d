"""SmoothQuant: move activation outliers into the weights with exact per-channel scales.

Per smoothing mapping (a norm or Linear and the balance layers reading its output: the model
patch's ``smoothing_mappings``, or the recipe's ``mappings``), one forward pre-hook on the first
balance layer keeps a single float32 vector: the per-channel ``max|x|`` over every calibration
token. When the piece holding the mapping was calibrated, the scales
(:func:`~layerwise.algorithms.quantization.smoothquant.smoothquant_scales`) are folded into the model
(:func:`~layerwise.algorithms.quantization.smoothing.apply_smoothing`): the function is unchanged, the balance
layers' inputs are flatter. SmoothQuant quantizes nothing itself.

**Order.** The lifecycle fires every event on the modifiers in recipe order
(:class:`~layerwise.host.lifecycle.Lifecycle`), so listed before a quantizer (``[SmoothQuantModifier,
GPTQModifier]``) it smooths a piece's mappings at ``sequential_epoch_end`` before that quantizer
compresses the piece's layers; listed after one, it finds the layers quantized and stops with an
error that says so. Both read the same calibration forward: the Gram matrices a Hessian modifier
gathered for the balance layers were built on unsmoothed inputs, and are rescaled to the smoothed
ones (:meth:`~layerwise.plugins.modifiers.hessians.HessianBank.rescale_inputs`) right after each
mapping is smoothed.

**Pieces.** Smoothing rescales the norm whose output a cut at layers would have cached for the
next piece, so :attr:`needs_uncompressed_block` makes the ``sequential`` pipeline cut at blocks:
each block is observed whole, smoothed (and compressed), then re-run from its own input. A
mapping split over two pieces, or whose layers saw no data, is not smoothed (warning).

**Ranks.** In a distributed run the maxima are maxed over the ranks before a piece is smoothed
(:meth:`SmoothQuantModifier.on_reduce`): every rank folds the very same scales.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from layerwise.plugin import CompressionState, ForeignField, Modifier, RecipeError, warn_user
from layerwise.plugin.calibration import NonFiniteSampleWarning, Reducer, is_finite, listed
from layerwise.plugin.quantization import (
    ResolvedMapping,
    apply_smoothing,
    discover_mappings,
    linear_weight,
    mappings_for_run,
    recipe_mappings,
    smoothquant_scales,
    split_by_piece,
)

from . import llm_compressor
from .hessians import HessianBank, layer_input
from .quantization import _in_piece

log = logging.getLogger("layerwise")


class SmoothQuantWarning(RuntimeWarning):
    """A mapping was left unsmoothed (the message says which and why)."""


@dataclass
class SmoothQuantModifier(Modifier):
    """Smooth every mapping with ``s = max|X| ** a / max|W| ** (1 - a)`` (``a``: ``smoothing_strength``).

    * ``smoothing_strength``: ``a`` in ``[0, 1]``, the share of the activations' range moved into
      the weights (0.5 suits most models; higher for models with larger activation outliers);
    * ``mappings``: ``[[balance patterns...], smoothed pattern]`` pairs (llm-compressor's form) or
      ``{smooth_layer, balance_layers}``; ``None`` (the default): the model patch's ``smoothing_mappings``.
    """

    requires_data: ClassVar[bool] = True
    min_calibration_samples: ClassVar[int] = 8
    foreign_fields: ClassVar[dict[str, ForeignField]] = llm_compressor.SMOOTHQUANT
    #: SmoothQuant moves activation outliers into the weights, then GPTQ int8 weights with int8 inputs
    chained_presets: ClassVar[dict[str, tuple[tuple[str, dict[str, Any]], ...]]] = {
        "SQ_GPTQ_W8A8": (("SmoothQuantModifier", {}), ("GPTQModifier", {"scheme": "W8A8"})),
    }
    needs_uncompressed_block: ClassVar[bool] = True
    block_reason: ClassVar[str] = ("rescales norms inside each block, whose outputs a cut at layers would have "
                                   "cached unsmoothed")

    smoothing_strength: float = 0.5
    mappings: list[Any] | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        alpha = self.smoothing_strength
        if (isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha)
                or not 0 <= alpha <= 1):
            raise RecipeError(f"{owner}.smoothing_strength must be a number in [0, 1] (typically 0.5), got {alpha!r}")
        self.mappings = recipe_mappings(self.mappings, owner)
        super().__post_init__()
        #: the scales folded in, per smoothed module (float32, on the CPU)
        self.scales: dict[str, torch.Tensor] = {}
        self._pending: dict[str, ResolvedMapping] = {}
        self._maxima: dict[str, torch.Tensor] = {}
        self._tokens: dict[str, int] = {}
        self._non_finite: dict[str, int] = {}
        self._unsmoothed: dict[str, list[str]] = {}  # why -> smoothed modules, warned about once per event

    def resolve(self, state: CompressionState) -> dict[str, ResolvedMapping]:
        """The mappings to smooth, by smoothed module; none at all is a :class:`MappingError`."""
        patch = state.model_patch
        mappings = mappings_for_run(state.model, patch, self.mappings, owner=type(self).__name__,
                                    discover=discover_mappings)
        return {m.smoothed: m for m in mappings}

    # -- events ------------------------------------------------------------------------
    def on_initialize(self, state: CompressionState) -> None:
        self.scales = {}
        self._pending = self.resolve(state)

    def on_calibration_start(self, state: CompressionState) -> None:
        self._maxima, self._tokens, self._non_finite = {}, {}, {}
        for smoothed, mapping in self._pending.items():
            first = state.model.get_submodule(mapping.balance[0])
            self.register_hook(first, self._max_hook(smoothed), "forward_pre", with_kwargs=True)

    def on_reduce(self, state: CompressionState, reducer: Reducer, modules: list[str] | None) -> None:
        """The per-channel maxima are maxed over the ranks, token and non-finite counts summed (exact)."""
        for smoothed, mapping in self._pending.items():
            if modules is not None and not _in_piece(mapping.balance[0], modules):
                continue
            maximum = self._maxima.get(smoothed)
            if maximum is None:  # no data here: the identity of max over |x| >= 0
                width = linear_weight(state.model.get_submodule(mapping.balance[0])).shape[-1]
                maximum = torch.zeros(width, dtype=torch.float32, device=state.execution_device)
            reducer.max(maximum)
            tokens = int(reducer.count(self._tokens.get(smoothed, 0)))
            dropped = int(reducer.count(self._non_finite.get(smoothed, 0)))
            self._tokens[smoothed] = tokens
            if dropped:
                self._non_finite[smoothed] = dropped
            if tokens:
                self._maxima[smoothed] = maximum
            else:
                self._maxima.pop(smoothed, None)

    def on_sequential_epoch_end(self, state: CompressionState, modules: list[str]) -> None:
        whole, split = split_by_piece(self._pending, modules)
        for mapping in whole:
            self.smooth(state, mapping)
        for mapping in split:
            self._skip(mapping, "split over two pieces of the model: the smoothed module's output was "
                                "cached before its balance layers were calibrated")
        self._warn_unsmoothed()

    def on_calibration_end(self, state: CompressionState) -> None:
        for mapping in list(self._pending.values()):  # nothing runs after this: smoothing is exact here
            self.smooth(state, mapping)
        self._warn_unsmoothed()

    def calibration_inputs(self, modules: list[str]) -> set[str]:
        """SmoothQuant reads only the input of each pending mapping's first balance layer."""
        return {m.balance[0] for m in self._pending.values() if _in_piece(m.balance[0], modules)}

    def remove_hooks(self) -> None:
        """Remove the hooks and forget the statistics still held (also after an error)."""
        super().remove_hooks()
        self._maxima.clear()

    # -- work --------------------------------------------------------------------------
    @torch.no_grad()
    def smooth(self, state: CompressionState, mapping: ResolvedMapping) -> None:
        """Fold the mapping's scales into the model, and into the Hessians gathered on its balance layers."""
        smoothed = mapping.smoothed
        self._pending.pop(smoothed, None)
        maximum, tokens = self._maxima.pop(smoothed, None), self._tokens.pop(smoothed, 0)
        dropped = self._non_finite.pop(smoothed, 0)
        if dropped:
            warn_user(f"SmoothQuant: {dropped} input(s) of {smoothed}'s balance layers held NaN or inf and were left "
                      f"out of its statistics", NonFiniteSampleWarning)
        if maximum is None:
            self._skip(mapping, "every calibration input held NaN or inf" if dropped else "no calibration data reached them")
            return
        model = state.model
        compressed = [n for n in (smoothed, *mapping.balance) if hasattr(model.get_submodule(n), "quantization_args")]
        if compressed:
            raise RecipeError(f"SmoothQuantModifier: {compressed[0]!r} is already quantized, so {smoothed!r} cannot be "
                              f"smoothed any more; list SmoothQuantModifier before the quantizing modifier in the "
                              f"recipe (modifiers act in recipe order)")
        weights = [linear_weight(model.get_submodule(name)) for name in mapping.balance]
        scales = smoothquant_scales(maximum, weights, self.smoothing_strength)
        apply_smoothing(model, mapping, scales)
        bank = getattr(state, "extensions", {}).get(HessianBank)
        if bank is not None:  # a Hessian modifier later in the recipe read the unsmoothed inputs
            bank.rescale_inputs(mapping.balance, scales)
        self.scales[smoothed] = scales.cpu()
        state.log.append({"modifier": type(self).__name__, "smoothed": smoothed, "balance": list(mapping.balance),
                          "tokens": tokens, "min_scale": float(scales.min()), "max_scale": float(scales.max())})
        log.info("SmoothQuant %s: %d tokens, scales %.3g to %.3g", smoothed, tokens, float(scales.min()),
                 float(scales.max()))

    def _skip(self, mapping: ResolvedMapping, why: str) -> None:
        self._pending.pop(mapping.smoothed, None)
        self._maxima.pop(mapping.smoothed, None)
        self._unsmoothed.setdefault(why, []).append(mapping.smoothed)

    def _warn_unsmoothed(self) -> None:
        """One warning per reason (a vision tower that text-only data never runs is dozens of mappings)."""
        for why, names in self._unsmoothed.items():
            warn_user(f"SmoothQuant: {len(names)} mapping(s) not smoothed ({why}): {listed(names)}", SmoothQuantWarning)
        self._unsmoothed = {}

    def _max_hook(self, smoothed: str):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = layer_input(args, kwargs)
            if not isinstance(x, torch.Tensor) or smoothed not in self._pending:
                return
            if not is_finite(x):  # one inf would make the channel's scale infinite
                self._non_finite[smoothed] = self._non_finite.get(smoothed, 0) + 1
                return
            flat = x.detach().reshape(-1, x.shape[-1])
            seen = flat.abs().amax(dim=0).to(torch.float32)
            maximum = self._maxima.get(smoothed)
            self._maxima[smoothed] = seen if maximum is None else torch.maximum(maximum, seen, out=maximum)
            self._tokens[smoothed] = self._tokens.get(smoothed, 0) + flat.shape[0]
        return hook
