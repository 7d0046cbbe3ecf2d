"""AutoRound weight quantization: each block's rounding and clipping learned against its own outputs.

Every sequential target (a decoder layer, ...) holding targeted Linears gets a forward hook that
keeps what the block receives (positional and keyword inputs) and what it returns, unquantized,
for at most ``nsamples`` calibration samples. When the pipeline reports the block calibrated
(``sequential_epoch_end``), :func:`~layerwise.algorithms.quantization.autoround.tune_block`
learns each of its Linears' rounding offsets and clipping factors by signed gradient descent so
that the block with quantized weights reproduces those outputs, and the weights are stored with
the learned values in the scheme's integer format (the saver packs them as round-to-nearest's).

The block must be observed whole before any of its layers changes, and re-run quantized
afterwards (:attr:`needs_uncompressed_block`): the ``sequential`` pipeline then cuts at blocks,
and each block's inputs are the quantized model's (the error of earlier blocks propagates, as
GPTQ's does). What its quantized output must reproduce is, by default (``match: model``, as in
AutoRound), the unquantized model's activations after that block: the pipeline carries the
uncompressed model's stream beside the quantized one (:attr:`needs_reference_inputs`, as for
GPTAQ) and the modifier's reference hook keeps each block's output there, so each block also
makes up for what the blocks before it lost (and a resumed run has that stream in its checkpoint).
Targeted layers outside every block (or in a block that saw no data) are rounded to nearest.
Memory: one block's samples (inputs and outputs) on the execution device, plus the block's
learned parameters (about three times its quantized weights, float32) while it is tuned.

With several data-parallel ranks each rank's samples are gathered before a block is tuned
(:meth:`AutoRoundModifier.on_reduce`), one rank tunes it and every rank stores the result.
Per block results are in :attr:`AutoRoundModifier.summary`, the run's log and
``autoround_summary.json`` next to the saved model.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from layerwise.plugin import CompressionState, ForeignField, RecipeError, find_modules, warn_user
from layerwise.plugin.calibration import Reducer, spread
from layerwise.plugin.quantization import (
    AutoRoundError,
    BlockSample,
    Rounding,
    TuneResult,
    block_output,
    check_autoround_args,
    is_transposed,
    linear_weight,
    quantize_learned,
    set_quantized_weight,
    tune_block,
)

from . import llm_compressor
from .quantization import QuantizationModifier, _in_piece

log = logging.getLogger("layerwise")

SUMMARY_FILE = "autoround_summary.json"
#: the accounting phase the tuning (and the replays of match: model) is timed under
TUNING_PHASE = "AutoRound tuning"
#: what a block's quantized output is matched to (see AutoRoundModifier.match)
MATCHES = ("model", "block")
#: what a step's forward may be autocast to (see AutoRoundModifier.step_dtype)
STEP_DTYPES = {None: None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
               "fp16": torch.float16}


@dataclass
class AutoRoundModifier(QuantizationModifier):
    """Quantize the weights of ``targets`` (minus ``ignore``) with ``scheme``, rounding learned per block.

    Scheme, targets, ignore and the ``num_bits`` / ``symmetric`` / ``strategy`` / ``group_size``
    overrides are :class:`QuantizationModifier`'s (integer weights per channel or group: W4A16,
    ``num_bits: 3`` or ``2`` for W3A16 / W2A16). AutoRound adds, with the paper's defaults:

    * ``iters``: signed-gradient steps per block (200);
    * ``lr``: step size of the rounding offsets, falling linearly to 0 (``None``: ``1 / iters``);
    * ``minmax_lr``: step size of the clipping factors (``None``: ``lr``);
    * ``batch_size``: calibration samples per step (8);
    * ``nsamples``: the most calibration samples a block is tuned on (128; the run's own count, from
      ``num_calibration_samples``, is used when smaller);
    * ``seed``: the order samples are drawn in (same seed and data, same result);
    * ``match``: what a block's quantized output must reproduce. ``"model"`` (AutoRound's choice): the
      unquantized model's activations there, i.e. the unquantized block run on the unquantized
      model's inputs (the pipeline's second stream, one more set of activations in its cache), so a
      block also corrects what earlier blocks' quantization moved; ``"block"``: the unquantized block
      on the inputs the quantized model gives it;
    * ``compile``: run each step through ``torch.compile`` (False): about a sixth less time per step on
      CPU, for a compilation of tens of seconds per block class (a C++ compiler is needed on CPU; where
      compiling fails the steps run uncompiled, with a warning). The compiled sums round differently,
      so results move at float-rounding level.
    * ``step_dtype``: ``bfloat16`` or ``float16`` (``bf16``, ``fp16``) runs each step's forward under
      ``torch.autocast`` in that dtype (null: the model's own dtype, the default): a float32 model's steps then
      take 0.6-0.76x the time on a CPU with native bfloat16 (AVX512-BF16, AMX; on a GPU not measured yet), as
      auto-round's ``amp`` does, while the learned values, the loss and the gradients stay float32. The results
      move a little (the steps see rounded activations); the kept rounding is still checked against
      round-to-nearest in the model's dtype.
    """

    requires_data: ClassVar[bool] = True
    min_calibration_samples: ClassVar[int] = 16
    preset_prefix: ClassVar[str | None] = "AUTOROUND"
    max_config_groups: ClassVar[int | None] = 1
    foreign_fields: ClassVar[dict[str, ForeignField]] = llm_compressor.AUTOROUND
    needs_uncompressed_block: ClassVar[bool] = True
    block_reason: ClassVar[str] = "tunes each block against its own unquantized outputs"

    iters: int = 200
    lr: float | None = None
    minmax_lr: float | None = None
    batch_size: int = 8
    nsamples: int = 128
    seed: int = 42
    match: str = "model"
    compile: bool = False
    step_dtype: str | None = None

    @property
    def needs_reference_inputs(self) -> bool:  # type: ignore[override]
        return self.match == "model"

    def __post_init__(self) -> None:
        if self.kv_cache_scheme is not None or self.attention_scheme is not None:
            raise RecipeError("AutoRoundModifier.kv_cache_scheme: put the KV cache on a QuantizationModifier after this one "
                              "(scheme: null, kv_cache_scheme: ...), which calibrates it on this modifier's weights")
        owner = type(self).__name__
        for name in ("iters", "batch_size", "nsamples", "seed"):
            value = getattr(self, name)
            low = 0 if name in ("iters", "seed") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise RecipeError(f"{owner}.{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.compile, bool):
            raise RecipeError(f"{owner}.compile must be true or false, got {self.compile!r}")
        for name in ("lr", "minmax_lr"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
                raise RecipeError(f"{owner}.{name} must be a number >= 0 or null (the default: 1 / iters), "
                                  f"got {value!r}")
        if not (self.step_dtype is None or isinstance(self.step_dtype, str)) or self.step_dtype not in STEP_DTYPES:
            raise RecipeError(f"{owner}.step_dtype must be null (the model's dtype), bfloat16 (bf16) or float16 "
                              f"(fp16), got {self.step_dtype!r}")
        if self.match not in MATCHES:
            raise RecipeError(f"{owner}.match must be one of {', '.join(MATCHES)}, got {self.match!r}")
        super().__post_init__()
        try:
            check_autoround_args(self.args)
        except AutoRoundError as exc:
            raise RecipeError(f"{owner}: {exc}") from None
        if self.input_args is not None:
            raise RecipeError(f"{owner} learns weight rounding only; use a weight-only scheme (W4A16, W4A16_ASYM) "
                              f"or put a QuantizationModifier for the activations after it")
        #: one record per block: name, layers, loss, rtn_loss, best_step, samples, seconds
        self.summary: list[dict[str, Any]] = []
        self._blocks: dict[str, torch.nn.Module] = {}
        self._samples: dict[str, list[BlockSample]] = {}
        #: each block's capture hook, removed before the block is tuned (the steps need no capture)
        self._captures: dict[str, torch.utils.hooks.RemovableHandle] = {}
        #: match: model: each block's output in the uncompressed stream for the batch being observed
        self._reference: dict[str, torch.Tensor] = {}

    # -- events ------------------------------------------------------------------------
    def on_initialize(self, state: CompressionState) -> None:
        super().on_initialize(state)
        self.summary = []
        blocks = find_modules(state.model, state.sequential_targets or [], state.ignore or [])
        self._blocks = {name: block for name, block in blocks.items()
                        if any(_in_piece(layer, [name]) for layer in self._modules)}
        self._samples = {}
        self._captures = {}
        self._reference = {}

    def on_calibration_start(self, state: CompressionState) -> None:
        super().on_calibration_start(state)
        # match: model takes each sample's target from the reference stream, so only the block's inputs are read
        # (a pre-hook, and the pipeline may skip the observed block's body); match: block needs its outputs
        kind = "forward_pre" if self.match == "model" else "forward"
        for name, block in self._blocks.items():
            self._samples[name] = []
            self._captures[name] = self.register_hook(block, self._capture_hook(name), kind, with_kwargs=True)

    def reference_hooks(self, modules: list[str]) -> list[torch.utils.hooks.RemovableHandle]:
        """``match: model``: the blocks of ``modules`` still to tune keep their output in the uncompressed model
        (the capture hook of the observed run that follows takes it as the sample's target)."""
        return [block.register_forward_hook(self._reference_hook(name)) for name, block in self._blocks.items()
                if name not in self._done and _in_piece(name, modules)]

    def on_reduce(self, state: CompressionState, reducer: Reducer, modules: list[str] | None) -> None:
        """Every rank's samples of the blocks about to be tuned, up to ``nsamples``, in the order one process
        would hold them: rank ``r`` calibrated batches ``r, r + world, ...``, so taking one from each rank
        in turn restores the run's order (and the same seed then tunes every block as one process does)."""
        super().on_reduce(state, reducer, modules)
        for name in self._blocks:
            if name in self._done or (modules is not None and not _in_piece(name, modules)):
                continue
            mine = self._samples.get(name, [])
            device = mine[0].target.device if mine else state.execution_device
            gathered = _interleaved(reducer.gather(mine))
            self._samples[name] = [_to(s, device) for s in _first_rows(gathered, self.nsamples)]

    def on_sequential_epoch_end(self, state: CompressionState, modules: list[str]) -> None:
        self.tune_blocks([name for name in self._blocks if name not in self._done and _in_piece(name, modules)],
                         state)
        super().on_sequential_epoch_end(state, modules)  # targeted layers outside blocks: round to nearest

    def on_calibration_end(self, state: CompressionState) -> None:
        self.tune_blocks([name for name in self._blocks if name not in self._done], state)
        super().on_calibration_end(state)
        if self.iters and self.summary and all(record["method"] == "rtn" for record in self.summary):
            warn_user(f"{type(self).__name__}: every block kept round-to-nearest ({len(self.summary)} blocks): "
                      f"{self.iters} steps of {self.batch_size} samples found nothing better, so the output is plain "
                      f"round-to-nearest; AutoRound pays with the paper's 200 steps and ~128 samples")

    def calibration_inputs(self, modules: list[str]) -> set[str] | None:
        """A block to tune: its inputs with ``match: model`` (the targets come from the reference stream), its
        whole forward with ``match: block`` (its outputs are the targets); elsewhere nothing is read."""
        tuned = {name for name in self._blocks if name not in self._done and _in_piece(name, modules)}
        if tuned and self.match == "block":
            return None
        return tuned

    def remove_hooks(self) -> None:
        """Remove the capture hooks and free every sample still held (also after an error)."""
        super().remove_hooks()
        self._captures.clear()
        self._samples.clear()
        self._reference.clear()

    def output_files(self) -> dict[str, str]:
        return {SUMMARY_FILE: json.dumps(self.summary, indent=1)} if self.summary else {}

    # -- work --------------------------------------------------------------------------
    def tune_blocks(self, names: list[str], state: CompressionState) -> None:
        """Tune blocks ``names`` (one rank each with several ranks) and store their layers' weights."""
        accounting = getattr(state, "accounting", None)  # the run's: the summary's time line names the phase
        with accounting.timed(TUNING_PHASE) if accounting is not None else contextlib.nullcontext():
            for name, result in spread(names, self._tune):
                self._store(name, result, state)

    def _layers(self, block_name: str) -> dict[str, torch.nn.Module]:
        """The block's targeted layers still to quantize, by name relative to the block."""
        prefix = block_name + "." if block_name else ""
        return {layer[len(prefix):]: module for layer, module in self._modules.items()
                if layer not in self._done and _in_piece(layer, [block_name]) and layer != block_name}

    def _tune(self, name: str) -> TuneResult | None:
        samples = self._samples.pop(name, [])
        if name in self._captures:  # a compiled step would trace it, and recompile for each block's own hook
            self._captures.pop(name).remove()
        layers = self._layers(name)
        if not samples or not layers:
            return None
        inputs = {rel: (linear_weight(m).detach(), self.args, is_transposed(m)) for rel, m in layers.items()}
        return tune_block(self._blocks[name], inputs, samples, iters=self.iters, lr=self.lr,
                          minmax_lr=self.minmax_lr, batch_size=self.batch_size, seed=self.seed,
                          compile=self.compile, step_dtype=STEP_DTYPES[self.step_dtype])

    @torch.no_grad()
    def _store(self, name: str, result: TuneResult | None, state: CompressionState) -> None:
        """Quantize the block's layers with the learned parameters (none: they stay for round-to-nearest)."""
        self._done.add(name)
        if result is None:
            log.warning("AutoRound: block %r saw no calibration data; its layers are rounded to nearest", name)
            return
        prefix = name + "." if name else ""
        for rel, module in self._layers(name).items():
            weight = linear_weight(module).detach()
            rounding = result.roundings[rel]
            device = weight.device
            rounding = Rounding(*(t.to(device) for t in rounding.tensors()))
            values, scale, zero_point = quantize_learned(weight, self.args, rounding, module.weight.dtype)
            set_quantized_weight(module, values, scale, zero_point, self.args, on_grid=True)
            self.quantize_inputs(prefix + rel, module)
            self._done.add(prefix + rel)
        record = {"name": name, "method": "autoround" if result.best_step >= 0 else "rtn",
                  "layers": sorted(result.roundings), "loss": result.loss, "rtn_loss": result.rtn_loss,
                  "best_step": result.best_step, "seconds": round(result.seconds, 4)}
        self.summary.append(record)
        state.log.append({"modifier": type(self).__name__, **record})
        log.info("AutoRound %s: loss %.4g (round-to-nearest %.4g), best step %d, %.2f s", name, result.loss,
                 result.rtn_loss, result.best_step, result.seconds)

    def _capture_hook(self, name: str):
        """Keeps a call's inputs and its target: the reference stream's output (``match: model``, a pre-hook:
        ``output`` is absent) or the block's own output (``match: block``)."""
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, *output: Any) -> None:
            reference = self._reference.pop(name, None)
            samples = self._samples.get(name)
            if samples is None or name in self._done or _rows(samples) >= self.nsamples:
                return
            if reference is None and not output:
                raise AutoRoundError(f"AutoRound block {name!r}: no reference output was kept for this batch "
                                     f"(match: model needs the pipeline's uncompressed stream)")
            target = reference if reference is not None else block_output(output[0]).detach().clone()
            samples.append(BlockSample(_copy(args), _copy(kwargs), target))
        return hook

    def _reference_hook(self, name: str):
        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            samples = self._samples.get(name)
            if samples is not None and _rows(samples) < self.nsamples:
                self._reference[name] = block_output(output).detach().clone()
        return hook


def _copy(value: Any) -> Any:
    """``value`` with its tensors (in tuples, lists and dicts) copied: the model may reuse its activations."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (tuple, list):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def _rows(samples: list[BlockSample]) -> int:
    return sum(s.target.shape[0] if s.target.ndim > 2 else 1 for s in samples)


def _interleaved(per_rank: list[list[BlockSample]]) -> list[BlockSample]:
    """Rank 0's first sample, rank 1's first, ..., rank 0's second, ...: the batches' own order."""
    merged: list[BlockSample] = []
    for position in range(max((len(samples) for samples in per_rank), default=0)):
        merged.extend(samples[position] for samples in per_rank if position < len(samples))
    return merged


def _first_rows(samples: list[BlockSample], limit: int) -> list[BlockSample]:
    kept: list[BlockSample] = []
    for sample in samples:
        if _rows(kept) >= limit:
            break
        kept.append(sample)
    return kept


def _to(sample: BlockSample, device: torch.device) -> BlockSample:
    def move(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        if type(value) in (tuple, list):
            return type(value)(move(v) for v in value)
        return value
    return BlockSample(move(sample.args), {k: move(v) for k, v in sample.kwargs.items()}, move(sample.target))
