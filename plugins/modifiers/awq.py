"""AWQ: activation-aware weight quantization, round-to-nearest after a searched smoothing.

Per smoothing mapping (a norm or Linear and the balance layers reading its output: the model
patch's ``smoothing_mappings``, or the recipe's ``mappings``), one forward pre-hook on the first
balance layer gathers what the search needs: the mean ``|x|`` of every input channel over all
calibration tokens, and at most ``search_tokens`` input rows, evenly spaced over those tokens.
When the piece holding the mapping was calibrated, :func:`~layerwise.algorithms.quantization.awq.search_scales`
picks the scales (never worse than round-to-nearest on those rows), they are folded into the
model (:func:`~layerwise.algorithms.quantization.smoothing.apply_smoothing`: the function is unchanged), and
every targeted layer of the piece is rounded to nearest with the scheme, mapped or not, so AWQ
alone yields a fully quantized model.

Smoothing rescales the module whose output the piece cached, so each block is observed before
any of it changes and re-run from its own input afterwards (:attr:`needs_uncompressed_block`).
A mapping split over two pieces, or whose layers saw no data, is not smoothed (warning); its
layers are still rounded to nearest. In a distributed run the ranks' samples are merged before
a piece is smoothed (:meth:`AWQModifier.on_reduce`): the mean ``|x|`` exactly, the search rows
approximately (every rank's rows thinned evenly; one process keeps another even spacing), and
every rank searches the same merged sample, so all fold the same scales. Per mapping results are in :attr:`AWQModifier.summary`, the
run's log and ``awq_summary.json`` next to the saved model.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from layerwise.plugin import (
    AlgorithmFallbackWarning,
    CompressionState,
    ForeignField,
    RecipeError,
    warn_user,
)
from layerwise.plugin.calibration import Accounting, NonFiniteSampleWarning, Reducer, is_finite
from layerwise.plugin.quantization import (
    MappingError,
    ResolvedMapping,
    apply_smoothing,
    discover_mappings,
    linear_weight,
    mappings_for_run,
    recipe_mappings,
    search_flops,
    search_scales,
    split_by_piece,
)

from . import llm_compressor
from .hessians import layer_input
from .quantization import QuantizationModifier, _in_piece

log = logging.getLogger("layerwise")

SUMMARY_FILE = "awq_summary.json"
#: accounting phase of the scale searches (see layerwise.runtime.accounting)
SEARCH_PHASE = "AWQ search"


class AWQFallbackWarning(AlgorithmFallbackWarning):
    """A mapping was not smoothed; its layers were rounded to nearest as they are (the message says why)."""


@dataclass
class AWQModifier(QuantizationModifier):
    """Smooth each mapping with searched scales, then round every targeted layer to nearest.

    Scheme, targets, ignore and the ``num_bits`` / ``symmetric`` / ``strategy`` / ``group_size`` /
    ``observer`` overrides are :class:`QuantizationModifier`'s (default scheme ``W4A16_ASYM``). AWQ adds:

    * ``mappings``: ``[[balance patterns...], smoothed pattern]`` pairs or llm-compressor's
      ``{smooth_layer, balance_layers}``; ``None``: the model patch's ``smoothing_mappings``;
    * ``duo_scaling``: divide the activation term by the weights' relative magnitude
      (``s = x_mean ** a / w_mean ** (1 - a)``) instead of ``s = x_mean ** a``;
    * ``n_grid``: how many ``a`` in ``[0, 1)`` are tried;
    * ``search_tokens``: the most input rows kept per mapping to score candidates on
      (float32, ``search_tokens x width`` each; the mean ``|x|`` still sees every token).
    """

    requires_data: ClassVar[bool] = True
    min_calibration_samples: ClassVar[int] = 16
    preset_prefix: ClassVar[str | None] = "AWQ"
    foreign_fields: ClassVar[dict[str, ForeignField]] = llm_compressor.AWQ
    max_config_groups: ClassVar[int | None] = 1
    #: smoothing changes the module whose output was cached: each block is observed whole, then re-run
    needs_uncompressed_block: ClassVar[bool] = True
    block_reason: ClassVar[str] = "smooths the norm (or Linear) whose output a block's layers read"

    scheme: Any = "W4A16_ASYM"
    mappings: list[Any] | None = None
    duo_scaling: bool = True
    n_grid: int = 20
    search_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.kv_cache_scheme is not None or self.attention_scheme is not None:
            raise RecipeError("AWQModifier.kv_cache_scheme: put the KV cache on a QuantizationModifier after this one "
                              "(scheme: null, kv_cache_scheme: ...), which calibrates it on this modifier's weights")
        owner = type(self).__name__
        if not isinstance(self.duo_scaling, bool):
            raise RecipeError(f"{owner}.duo_scaling must be true or false, got {self.duo_scaling!r}")
        for name in ("n_grid", "search_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise RecipeError(f"{owner}.{name} must be a positive integer, got {value!r}"
                                  + (" (n_grid: 20 tries a = 0, 0.05, ..., 0.95)" if name == "n_grid" else ""))
        self.mappings = recipe_mappings(self.mappings, owner)
        super().__post_init__()
        inputs = getattr(self, "input_args", None)  # a scheme that also quantizes layer inputs
        if inputs is not None and inputs.calibrated:  # static scales, NVFP4's global input scale
            raise RecipeError(f"{owner}: calibrated input scales would be calibrated on inputs that smoothing then "
                              f"rescales; use a weight-only scheme (W4A16_ASYM, W4A16, W8A16, NVFP4A16) or a "
                              f"dynamic one")
        #: one record per mapping: smoothed, balance, method, alpha, loss, rtn_loss, tokens, seconds
        self.summary: list[dict[str, Any]] = []
        #: the scales folded in, per smoothed module (float32, on the CPU)
        self.scales: dict[str, torch.Tensor] = {}
        self._pending: dict[str, ResolvedMapping] = {}
        self._stats: dict[str, InputSample] = {}
        self._handles: dict[str, torch.utils.hooks.RemovableHandle] = {}
        self._accounting = Accounting()

    # -- configuration -----------------------------------------------------------------
    def resolve_pending(self, state: CompressionState) -> dict[str, ResolvedMapping]:
        """The mappings to search, by smoothed module: resolved on the model, each with a targeted layer."""
        owner = type(self).__name__
        patch = state.model_patch
        mappings = mappings_for_run(state.model, patch, self.mappings, owner=owner, discover=discover_mappings)
        _check_disjoint(owner, mappings)
        pending: dict[str, ResolvedMapping] = {}
        for mapping in mappings:
            if any(layer in self._modules for layer in mapping.balance):
                pending[mapping.smoothed] = mapping
            else:
                log.info("%s: %s is not smoothed: none of its balance layers is quantized", owner, mapping.smoothed)
        return pending

    # -- events ------------------------------------------------------------------------
    def on_initialize(self, state: CompressionState) -> None:
        super().on_initialize(state)
        self.summary = []
        self.scales = {}
        self._pending = self.resolve_pending(state)
        self._stats = {}
        accounting = getattr(state, "accounting", None)
        self._accounting = accounting if accounting is not None else Accounting()

    def on_calibration_start(self, state: CompressionState) -> None:
        super().on_calibration_start(state)
        for smoothed, mapping in self._pending.items():
            self._stats[smoothed] = InputSample(self.search_tokens)
            first = state.model.get_submodule(mapping.balance[0])
            self._handles[smoothed] = self.register_hook(first, self._sample_hook(smoothed), "forward_pre",
                                                         with_kwargs=True)

    def on_reduce(self, state: CompressionState, reducer: Reducer, modules: list[str] | None) -> None:
        """Merge each pending mapping's sample over the ranks (:meth:`InputSample.merge`): the mean ``|x|``
        exactly, the search rows as the ranks' rows thinned to ``search_tokens``."""
        super().on_reduce(state, reducer, modules)
        for smoothed, mapping in self._pending.items():
            if modules is not None and not _in_piece(mapping.balance[0], modules):
                continue
            sample = self._stats.get(smoothed)
            if sample is None:
                continue
            merged = InputSample.merge(reducer.gather(sample.portable()), self.search_tokens)
            device = sample.device or state.execution_device
            self._stats[smoothed] = merged.to(device)

    def on_sequential_epoch_end(self, state: CompressionState, modules: list[str]) -> None:
        whole, split = split_by_piece(self._pending, modules)
        for mapping in whole:
            self.smooth(state, mapping)
        for mapping in split:
            self._drop(mapping, "its layers are in different pieces of the model (the smoothed module's "
                                "output was cached before the balance layers were calibrated)")
        super().on_sequential_epoch_end(state, modules)

    def on_calibration_end(self, state: CompressionState) -> None:
        for mapping in list(self._pending.values()):  # nothing runs after this: smoothing is exact here
            self.smooth(state, mapping)
        super().on_calibration_end(state)

    def calibration_inputs(self, modules: list[str]) -> set[str]:
        """AWQ reads only the input of each pending mapping's first balance layer."""
        return {m.balance[0] for m in self._pending.values() if _in_piece(m.balance[0], modules)}

    def remove_hooks(self) -> None:
        """Remove the sampling hooks and free every sample still held (also after an error)."""
        super().remove_hooks()
        self._handles.clear()
        self._stats.clear()

    def output_files(self) -> dict[str, str]:
        return {SUMMARY_FILE: json.dumps(self.summary, indent=1)} if self.summary else {}

    # -- work --------------------------------------------------------------------------
    @torch.no_grad()
    def smooth(self, state: CompressionState, mapping: ResolvedMapping) -> None:
        """Search the mapping's scales on its sample and fold them into the model (not quantized yet)."""
        sample = self._finish(mapping.smoothed)
        dropped = sample.non_finite if sample is not None else 0
        if dropped:
            warn_user(f"AWQ: {dropped} input(s) of {mapping.smoothed}'s balance layers held NaN or inf and were left "
                      f"out of its statistics", NonFiniteSampleWarning)
        if sample is None or sample.tokens == 0:
            why = "every calibration input held NaN or inf" if dropped else "it saw no calibration data"
            self._record(state, mapping, "rtn", reason=why)
            warn_user(f"AWQ: {mapping.smoothed} is not smoothed: {why}; its balance layers are rounded to nearest",
                      AWQFallbackWarning)
            return
        start = time.perf_counter()
        layers = [name for name in mapping.balance if name in self._modules]
        weights = [linear_weight(state.model.get_submodule(name)).detach().to(torch.float32) for name in layers]
        rows, x_mean = sample.rows().to(weights[0].device), sample.mean().to(weights[0].device)
        with self._accounting.timed(SEARCH_PHASE, search_flops(rows.shape[0], weights, self.n_grid)):
            result = search_scales(rows, x_mean, weights, self.args, n_grid=self.n_grid,
                                   duo_scaling=self.duo_scaling, observer=self._observer)
        del rows, weights
        if result.alpha is not None:
            apply_smoothing(state.model, mapping, result.scales)
            self.scales[mapping.smoothed] = result.scales.detach().cpu()
        self._record(state, mapping, "awq" if result.alpha is not None else "rtn", alpha=result.alpha,
                     loss=result.loss, rtn_loss=result.rtn_loss, tokens=sample.tokens, sample_tokens=sample.kept,
                     seconds=round(time.perf_counter() - start, 4),
                     **({"non_finite_inputs": dropped} if dropped else {}))
        log.info("AWQ %s: alpha %s, loss %.4g (round-to-nearest %.4g), %d tokens", mapping.smoothed,
                 "none (RTN kept)" if result.alpha is None else f"{result.alpha:g}", result.loss, result.rtn_loss,
                 sample.tokens)

    def _finish(self, smoothed: str) -> InputSample | None:
        """Stop sampling for ``smoothed``'s mapping: its hook goes, its sample is handed over once."""
        self._pending.pop(smoothed, None)
        handle = self._handles.pop(smoothed, None)
        if handle is not None:
            handle.remove()
        return self._stats.pop(smoothed, None)

    def _drop(self, mapping: ResolvedMapping, why: str) -> None:
        self._finish(mapping.smoothed)
        self.summary.append({"smoothed": mapping.smoothed, "balance": list(mapping.balance), "method": "rtn",
                             "reason": why})
        warn_user(f"AWQ: {mapping.smoothed} is not smoothed: {why}; its balance layers are rounded to nearest",
                  AWQFallbackWarning)

    def _record(self, state: CompressionState, mapping: ResolvedMapping, method: str, **fields: Any) -> None:
        # named by the layer it smoothed, as GPTQ's records are by the layer solved: charts and tables read it
        record = {"name": mapping.smoothed, "smoothed": mapping.smoothed, "balance": list(mapping.balance),
                  "method": method, **fields}
        self.summary.append(record)
        state.log.append({"modifier": type(self).__name__, **record})

    def _sample_hook(self, smoothed: str):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            x = layer_input(args, kwargs)
            sample = self._stats.get(smoothed)
            if sample is None or not isinstance(x, torch.Tensor):
                return
            if not is_finite(x):  # one NaN would poison the mean and every candidate's loss
                sample.non_finite += 1
                return
            sample.add(x.detach().reshape(-1, x.shape[-1]))
        return hook


def _check_disjoint(owner: str, mappings: tuple[ResolvedMapping, ...]) -> None:
    """Each module smoothed by one mapping, each layer balancing one: scales folded twice would not cancel."""
    smoothed: set[str] = set()
    balanced: dict[str, str] = {}  # balance layer -> its smoothed module
    for mapping in mappings:
        if mapping.smoothed in smoothed:
            raise MappingError(f"{owner}: {mapping.smoothed!r} is smoothed by two mappings; every layer reading "
                               f"its output belongs in one mapping (scaling it for one would change the others)")
        smoothed.add(mapping.smoothed)
        for layer in mapping.balance:
            if layer in balanced:
                raise MappingError(f"{owner}: layer {layer!r} balances both {balanced[layer]!r} and "
                                   f"{mapping.smoothed!r}; a layer can balance one mapping only")
            balanced[layer] = mapping.smoothed


class InputSample:
    """Mean ``|x|`` per channel over every token seen, and at most ``limit`` rows evenly spaced over them.

    Rows are kept where the token's running index is a multiple of ``stride``; when more than
    ``limit`` are held, every second one goes and ``stride`` doubles. The result depends only on
    the tokens and their order (no random draw), and holds between ``limit / 2`` and ``limit`` rows
    once that many tokens were seen.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.tokens = 0
        self.non_finite = 0
        self.stride = 1
        self._abs_sum: torch.Tensor | None = None
        self._rows: list[torch.Tensor] = []

    @property
    def kept(self) -> int:
        return sum(r.shape[0] for r in self._rows)

    def add(self, flat: torch.Tensor) -> None:
        """Fold a ``(tokens, channels)`` batch of inputs in."""
        flat = flat.to(torch.float32)
        magnitude = flat.abs().sum(dim=0)
        self._abs_sum = magnitude if self._abs_sum is None else self._abs_sum.add_(magnitude)
        first = -self.tokens % self.stride  # the first row whose running index is a multiple of stride
        self._rows.append(flat[first::self.stride].clone())
        self.tokens += flat.shape[0]
        while self.kept > self.limit:
            self._rows = [torch.cat(self._rows)[::2].clone()]
            self.stride *= 2

    @property
    def device(self) -> torch.device | None:
        return self._abs_sum.device if self._abs_sum is not None else None

    def portable(self) -> InputSample:
        """A copy on the CPU, to send to the other ranks."""
        copy = InputSample(self.limit)
        copy.tokens, copy.non_finite, copy.stride = self.tokens, self.non_finite, self.stride
        copy._abs_sum = None if self._abs_sum is None else self._abs_sum.cpu()
        copy._rows = [torch.cat(self._rows).cpu()] if self._rows else []
        return copy

    def to(self, device: torch.device) -> InputSample:
        self._abs_sum = None if self._abs_sum is None else self._abs_sum.to(device)
        self._rows = [r.to(device) for r in self._rows]
        return self

    @staticmethod
    def merge(samples: list[InputSample], limit: int) -> InputSample:
        """The ranks' samples as one: tokens, non-finite counts and ``|x|`` sums add up (so the mean is
        exact); the rows are every rank's, in rank order, thinned evenly to at most ``limit``. An
        approximation: one process would have kept a different even spacing of the same tokens."""
        merged = InputSample(limit)
        rows = []
        for sample in samples:
            merged.tokens += sample.tokens
            merged.non_finite += sample.non_finite
            if sample._abs_sum is not None:
                merged._abs_sum = (sample._abs_sum.clone() if merged._abs_sum is None
                                   else merged._abs_sum.add_(sample._abs_sum))
            rows.extend(sample._rows)
        if rows:
            stacked = torch.cat(rows)
            step = -(-stacked.shape[0] // limit)  # ceil: at most ``limit`` rows stay
            merged._rows = [stacked[::step].clone()]
            merged.stride = step
        return merged

    def mean(self) -> torch.Tensor:
        if self._abs_sum is None:
            raise ValueError("no input was sampled")
        return self._abs_sum / self.tokens

    def rows(self) -> torch.Tensor:
        return torch.cat(self._rows)
