"""What every pruning modifier shares: the recipe fields, the layers, writing a mask back, the summary.

A pruning modifier zeroes a fraction ``sparsity`` of the weights of each targeted layer
(``mask_structure`` ``"0:0"``: anywhere; ``"N:M"``: N of every M consecutive input
columns), leaves exact zeros in the dense ``weight`` and marks the layer with its
structure (:func:`layerwise.algorithms.sparsity.mark_sparse`), which later modifiers (GPTQ keeps
the zeros) and the saver (sparse compressed-tensors formats) read. Every bad value is a
:class:`~layerwise.errors.RecipeError` when the recipe is parsed, or, for a layer whose
width does not fit ``N:M``, when the run starts: before any calibration.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from layerwise.plugin import (
    AlgorithmFallbackWarning,
    CompressionState,
    Modifier,
    RecipeError,
    find_modules,
    warn_user,
)
from layerwise.plugin.calibration import Reducer, check, spread, world_size
from layerwise.plugin.quantization import is_transposed, linear_weight, replace_data
from layerwise.plugin.sparsity import (
    MaskStructure,
    check_sparsity,
    magnitude_mask,
    mark_sparse,
    parse_mask_structure,
)

from .owl import input_norms, owl_sparsities
from .quantization import _in_piece, target_lists, targeted_modules

log = logging.getLogger("layerwise")


#: llm-compressor's SparseGPT / Wanda target for every layer of the model
ALL_TARGET = "__ALL__"
#: the pattern that selects the model itself (named ``""``)
_WHOLE_MODEL = "re:"
#: fields left out of the saved recipe when unset (their defaults are derived, not literal)
_OPTIONAL = ("sparsity", "owl_m", "owl_lmbda")


class PruningFallbackWarning(AlgorithmFallbackWarning):
    """A layer was magnitude-pruned instead (the message says which and why)."""


@dataclass
class PruningModifier(Modifier):
    """Base of the pruning modifiers: ``sparsity`` of ``targets`` (minus ``ignore``) in ``mask_structure``.

    ``sparsity`` defaults to 0.5 for unstructured masks and to N/M for ``N:M``, where
    giving a different value is an error (the structure fixes it). A list (llm-compressor's per-layer form) gives
    one value per module ``targets`` select, in model order and ``ignore`` aside, as llm-compressor counts them:
    the layers inside each (or the layer itself) get its value; a count that differs is an error before any
    calibration. ``owl_m`` and
    ``owl_lmbda`` (unstructured only; typically 5 and 0.08) turn on OWL: each block gets its
    own sparsity from its share of outlier weights, the mean staying ``sparsity`` and the
    most and least pruned blocks ``2 owl_lmbda`` apart
    (:mod:`.owl`; costs one extra forward of the whole dense model over the calibration data).
    """

    requires_data: ClassVar[bool] = True
    min_calibration_samples: ClassVar[int] = 16
    #: the file of per-layer records saved next to the model
    summary_file: ClassVar[str] = "pruning_summary.json"

    sparsity: float | list[float] | None = None
    mask_structure: str = "0:0"
    targets: list[str] = field(default_factory=lambda: ["Linear"])
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    owl_m: float | None = None
    owl_lmbda: float | None = None
    #: ``False`` (default, the papers'): every layer of a block is calibrated on the block's unpruned
    #: inputs (the pipeline cuts at blocks); ``True``: on the inputs of the model pruned so far (a cut at
    #: layers, one forward per piece)
    true_sequential: bool = False

    @property
    def needs_uncompressed_block(self) -> bool:  # type: ignore[override]
        return not self.true_sequential

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if not isinstance(self.true_sequential, bool):
            raise RecipeError(f"{owner}.true_sequential must be true or false, got {self.true_sequential!r}")
        super().__post_init__()
        self.targets, self.ignore = target_lists(owner, self.targets, self.ignore)
        self.structure: MaskStructure = parse_mask_structure(self.mask_structure, f"{owner}.mask_structure")
        implied = self.structure.sparsity
        #: llm-compressor's per-layer list, checked (``None``: one sparsity for every layer)
        self.sparsity_list: list[float] | None = self._read_sparsity_list(owner)
        if self.sparsity is None:
            self.fraction = 0.5 if implied is None else implied
        else:
            given = self.sparsity_list or [check_sparsity(self.sparsity, f"{owner}.sparsity")]
            self.fraction = sum(given) / len(given)  # the list's mean: what a summary reports
            for value in given:
                if implied is not None and abs(value - implied) > 1e-9:
                    raise RecipeError(f"{owner}: sparsity {value!r} contradicts mask_structure "
                                      f"{self.mask_structure!r}, which prunes {implied:g} of the weights; leave "
                                      f"sparsity out, or use mask_structure '0:0' for unstructured sparsity")
        self._check_owl(owner)
        #: per layer, the sparsity OWL chose (empty without OWL)
        self.layer_sparsity: dict[str, float] = {}
        #: one record per pruned layer: name, method, sparsity, loss, seconds, samples
        self.summary: list[dict[str, Any]] = []
        self._modules: dict[str, torch.nn.Module] = {}
        self._done: set[str] = set()

    def to_dict(self) -> dict[str, Any]:
        """The recipe entry, leaving out the optional fields that were not given (``sparsity``, OWL)."""
        ((name, fields),) = super().to_dict().items()
        return {name: {k: v for k, v in fields.items() if not (v is None and k in _OPTIONAL)}}

    # -- layers ------------------------------------------------------------------------
    def resolve_modules(self, state: CompressionState) -> dict[str, torch.nn.Module]:
        """The layers to prune; errors for a target matching nothing or a width N:M cannot cut."""
        # a target may name a block (its Linear layers are pruned); __ALL__, the model: every layer in it
        targets = [_WHOLE_MODEL if target == ALL_TARGET else target for target in self.targets]
        modules = targeted_modules(type(self).__name__, state, targets, self.ignore, within=True)
        for name, module in modules.items():
            self.structure.check_columns(linear_weight(module).shape[-1], name)
        return modules

    def sparsity_for(self, name: str) -> float:
        """The fraction to prune in layer ``name``: OWL's for its block, or the list's, else ``sparsity``."""
        return self.layer_sparsity.get(name, self.fraction)

    def _read_sparsity_list(self, owner: str) -> list[float] | None:
        """``sparsity`` given as a list, each value checked; ``None`` for one number (or none)."""
        if not isinstance(self.sparsity, (list, tuple)):
            return None
        if not self.sparsity:
            raise RecipeError(f"{owner}.sparsity is an empty list; give one fraction (0.5), or one per module the "
                              f"targets select")
        if self.owl_m is not None or self.owl_lmbda is not None:
            raise RecipeError(f"{owner}: OWL (owl_m, owl_lmbda) chooses each block's sparsity around one mean; give "
                              f"sparsity as one number with OWL, or the per-layer list without it")
        return [check_sparsity(value, f"{owner}.sparsity[{i}]") for i, value in enumerate(self.sparsity)]

    def listed_sparsities(self, model: torch.nn.Module, layers: list[str]) -> dict[str, float]:
        """With a sparsity list: each of ``layers`` -> the value of the innermost module ``targets`` select that
        holds it (or is it); the list must have one value per selected module (``ignore`` aside, as in
        llm-compressor), else an error saying how many."""
        if self.sparsity_list is None:
            return {}
        targets = [_WHOLE_MODEL if target == ALL_TARGET else target for target in self.targets]
        selected = list(find_modules(model, targets))
        if len(selected) != len(self.sparsity_list):
            shown = ", ".join(map(repr, selected[:4])) + (", ..." if len(selected) > 4 else "")
            raise RecipeError(f"{type(self).__name__}.sparsity lists {len(self.sparsity_list)} values, one per module "
                              f"the targets {self.targets} select (ignore aside, as llm-compressor counts them), but "
                              f"they select {len(selected)}: {shown}; give {len(selected)} values, or targets "
                              f"selecting {len(self.sparsity_list)} modules (e.g. the blocks: "
                              f"'re:model.layers.\\d+$')")
        value = dict(zip(selected, self.sparsity_list))
        owners = {layer: max((s for s in selected if s in ("", layer) or layer.startswith(s + ".")), key=len)
                  for layer in layers}
        return {layer: value[owner] for layer, owner in owners.items()}

    def _check_owl(self, owner: str) -> None:
        if self.owl_m is None and self.owl_lmbda is None:
            return
        if self.owl_m is None or self.owl_lmbda is None:
            raise RecipeError(f"{owner}: OWL needs both owl_m (outlier threshold, e.g. 5) and owl_lmbda (the most "
                              f"a block's sparsity may move, e.g. 0.08); give both or neither")
        if not self.structure.unstructured:
            raise RecipeError(f"{owner}: OWL chooses a sparsity per block, which mask_structure "
                              f"{self.mask_structure!r} fixes; use mask_structure '0:0' with owl_m / owl_lmbda")
        if isinstance(self.owl_m, bool) or not isinstance(self.owl_m, (int, float)) or not self.owl_m > 0:
            raise RecipeError(f"{owner}.owl_m must be a number > 0 (e.g. 5), got {self.owl_m!r}")
        room = min(self.fraction, 1 - self.fraction) / 2  # blocks spread over 2 lmbda around the mean
        if (isinstance(self.owl_lmbda, bool) or not isinstance(self.owl_lmbda, (int, float))
                or not 0 <= self.owl_lmbda < room):
            raise RecipeError(f"{owner}.owl_lmbda must be in [0, {room:g}) so that every block's sparsity stays "
                              f"in [0, 1) around {self.fraction:g}, got {self.owl_lmbda!r} (e.g. 0.08)")

    # -- events ------------------------------------------------------------------------
    def on_initialize(self, state: CompressionState) -> None:
        self._modules = self.resolve_modules(state)
        self._done = set()
        self.summary = []
        self.layer_sparsity = self.listed_sparsities(state.model, list(self._modules))

    def on_calibration_start(self, state: CompressionState) -> None:
        """With OWL: one forward of the dense model for the input norms, then a sparsity per block."""
        if self.owl_m is None or not self._modules:
            return
        norms = input_norms(state.model, self._modules, list(getattr(state, "batches", []) or []))
        if world_size() > 1:  # each rank ran its share of the batches: the sums of squares add up
            norms = _summed_over_ranks(norms, self._modules)
        blocks = find_modules(state.model, state.sequential_targets) if state.sequential_targets else {}
        self.layer_sparsity = owl_sparsities(self._modules, blocks, norms, self.fraction, self.owl_m,
                                             self.owl_lmbda)

    def on_sequential_epoch_end(self, state: CompressionState, modules: list[str]) -> None:
        self.prune_modules([name for name in self._modules if name not in self._done and _in_piece(name, modules)],
                           state)

    def on_calibration_end(self, state: CompressionState) -> None:
        self.prune_modules([name for name in self._modules if name not in self._done], state)

    def calibration_inputs(self, modules: list[str]) -> set[str]:
        """A pruning modifier reads only the inputs of its layers still to be pruned."""
        return {name for name in self._modules if name not in self._done and _in_piece(name, modules)}

    def output_files(self) -> dict[str, str]:
        return {self.summary_file: json.dumps(self.summary, indent=1)} if self.summary else {}

    # -- work --------------------------------------------------------------------------
    def prune_modules(self, names: list[str], state: CompressionState | None = None) -> None:
        """Prune layers ``names`` (:meth:`prune_module` each); with several ranks each rank solves its share
        and every rank applies them all."""
        if world_size() == 1:
            for name in names:
                self.prune_module(name, self._modules[name], state)
            return
        for name, (pruned, record, seconds) in spread(names, self._solve_layer, skip=self.skip_layer):
            self._apply(name, self._modules[name], pruned, record, seconds, state)

    def prune_module(self, name: str, module: torch.nn.Module, state: CompressionState | None = None) -> None:
        """Prune one layer (subclasses: :meth:`solve`), write the result back and record it."""
        self._apply(name, module, *self._solve_layer(name, module), state)

    def _solve_layer(self, name: str, module: torch.nn.Module | None = None
                     ) -> tuple[torch.Tensor, dict[str, Any], float]:
        """The pruned float32 ``(out, in)`` weight of one layer, its record and the seconds it took."""
        start = time.perf_counter()
        weight = linear_weight(self._modules[name] if module is None else module)
        pruned, record = self.solve(name, weight.detach().to(torch.float32))
        if pruned is None:
            pruned = weight.detach().to(torch.float32) * ~magnitude_mask(weight, self.structure,
                                                                        self.sparsity_for(name))
        return pruned, record, time.perf_counter() - start

    def skip_layer(self, name: str) -> None:
        """Another rank solves layer ``name`` (distributed runs): drop what this rank holds for it."""

    def _apply(self, name: str, module: torch.nn.Module, pruned: torch.Tensor, record: dict[str, Any],
               seconds: float, state: CompressionState | None) -> None:
        """Write a pruned layer back and record it (every rank, for every layer)."""
        start = time.perf_counter() - seconds
        weight = linear_weight(module)
        if record.get("method") == "magnitude" and "reason" in record:
            reason = record.pop("reason")
            warn_user(f"{type(self).__name__}: layer {name!r} is magnitude-pruned instead: {reason}",
                      PruningFallbackWarning)
        write_pruned(module, pruned)
        mark_sparse(module, self.structure)
        self._done.add(name)
        zeros = float((linear_weight(module) == 0).sum()) / max(weight.numel(), 1)
        record = {"name": name, **record, "sparsity": round(zeros, 6),
                  "seconds": round(time.perf_counter() - start, 4)}
        self.summary.append(record)
        if state is not None:
            state.log.append({"modifier": type(self).__name__, **record})
        log.info("%s %s: %s, sparsity %.3f, %.3f s", type(self).__name__, name, record.get("method"), zeros,
                 record["seconds"])

    def solve(self, name: str, weight: torch.Tensor) -> tuple[torch.Tensor | None, dict[str, Any]]:
        """The pruned ``(out, in)`` float32 weight and the layer's record; ``None`` to magnitude-prune."""
        raise NotImplementedError

    def fallback(self, name: str, reason: str, record: dict[str, Any]) -> tuple[None, dict[str, Any]]:
        """Magnitude-prune ``name`` instead, with a warning (when the layer is written back) that says why;
        ``record`` joins the layer's record."""
        return None, {"method": "magnitude", "reason": reason, **record}


def _summed_over_ranks(norms: dict[str, torch.Tensor], layers: dict[str, torch.nn.Module]) -> dict[str, torch.Tensor]:
    """OWL's per-layer input sums of squares summed over the ranks (a layer without data here adds zeros)."""
    check()  # the ranks meet first: a failed one is an error here, not a mismatched collective
    reducer = Reducer()
    summed = {}
    for name, module in layers.items():
        total = norms.get(name)
        if total is None:
            total = torch.zeros(linear_weight(module).shape[-1], dtype=torch.float32,
                                device=next(iter(norms.values())).device if norms else "cpu")
        summed[name] = reducer.sum(total)
    return summed


@torch.no_grad()
def write_pruned(module: torch.nn.Module, pruned: torch.Tensor) -> None:
    """Give the module a pruned ``(out, in)`` weight (its layout and dtype; storage swapped, see
    :func:`~layerwise.algorithms.quantization.storage.replace_data`)."""
    target = module.weight
    values = pruned.to(device=target.device)
    replace_data(target, values.t().contiguous() if is_transposed(module) else values)
