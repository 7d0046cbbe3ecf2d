"""Calibrating the FP8 KV cache of a quantization modifier (its ``kv_cache_scheme``).

The attention layers are found and routed through layerwise's attention hook when the run initializes
(an error before any work if there are none, or one cannot be reached); while calibration data flows,
each layer keeps the largest key and value magnitude it saw (per tensor or per head), after the rotary
embedding; when its piece is done the scales ``amax / 448`` are set and from then on the layer computes
with FP8 keys and values, so later pieces, the evaluation and the saved checkpoint all see the served
cache. Math: :mod:`layerwise.algorithms.quantization.kv_cache`; hook: :mod:`~layerwise.algorithms.quantization.attention`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from layerwise.plugin import CompressionState, ModelPatch, RecipeError, matches
from layerwise.plugin.calibration import Reducer
from layerwise.plugin.quantization import (
    AttentionError,
    QuantizationArgs,
    attach,
    attention_state,
    find_attention_modules,
    kv_amax,
    kv_scale,
    set_attention_scales,
)

KINDS = ("key", "value")
#: the states each scale is computed from
SCALES = {"key": "k_scale", "value": "v_scale", "query": "q_scale"}
#: an attention layer's input projections (the output projection is its other Linear)
PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class KVCacheCalibration:
    """The KV cache part of one modifier: its attention layers, their running ranges, their scales."""

    def __init__(self, owner: str, args: QuantizationArgs, queries: bool = False,
                 query_targets: list[str] | None = None) -> None:
        self.owner = owner
        self.args = args
        #: FP8 attention: the queries of the attention layers ``query_targets`` selects (``None``: all) too
        self.queries = queries
        self.query_targets = query_targets
        self.query_names: set[str] = set()
        self.modules: dict[str, torch.nn.Module] = {}
        self.amax: dict[str, dict[str, torch.Tensor]] = {}
        self.done: set[str] = set()
        #: the scales set so far, by layer and buffer (CPU): what a resumed run puts back (:meth:`restore`)
        self.scales: dict[str, dict[str, torch.Tensor]] = {}

    def resolve(self, state: CompressionState, ignore: list[str] | None = None) -> None:
        """Find the attention layers (the patch's ``attention_modules`` or the default rule) minus those ``ignore``
        and the run's ignore list match, and route them through the hook; errors name the field and the fix. An
        ignored attention layer gets no KV scales (a VLM's vision encoder: it has no KV cache in vLLM)."""
        patch = state.model_patch
        model = type(state.model).__name__
        refusal = getattr(patch, "kv_cache_refusal", "")
        if refusal:
            raise RecipeError(f"{self.owner}.kv_cache_scheme: {model} (model patch {patch.name!r}): {refusal}")
        names = _attention_names(patch)
        found = attention_layers(state)
        ignored = list(dict.fromkeys([*(ignore or []), *(getattr(state, "ignore", None) or [])]))
        self.modules = {n: m for n, m in found.items() if not matches(n, m, ignored)}
        if not self.modules:
            rule = (f"the model patch's attention_modules {list(names)}" if names else
                    "modules whose class name ends in 'Attention' with k_proj and v_proj")
            if found:
                raise RecipeError(f"{self.owner}.kv_cache_scheme: every attention layer of {model} ({rule}: "
                                  f"{', '.join(sorted(found)[:3])}{', ...' if len(found) > 3 else ''}) is ignored "
                                  f"(ignore {ignored}), so no KV cache scale would be calibrated: narrow the ignore "
                                  f"entries or leave kv_cache_scheme out")
            raise RecipeError(f"{self.owner}.kv_cache_scheme: {model} has no attention layer "
                              f"({rule}); name its attention classes in the model patch (ModelPatch.attention_modules) "
                              f"or leave kv_cache_scheme out")
        for name, module in self.modules.items():
            try:
                attach(module, name)
            except AttentionError as exc:
                raise RecipeError(f"{self.owner}.kv_cache_scheme: {exc}") from None
        self.query_names = set()
        if self.queries:
            targets = self.query_targets
            self.query_names = {n for n, m in self.modules.items() if targets is None or matches(n, m, targets)}
            if not self.query_names:
                raise RecipeError(f"{self.owner}.targets {targets} match no attention layer for FP8 attention; "
                                  f"attention layers: {', '.join(sorted({type(m).__name__ for m in self.modules.values()}))}"
                                  f" (e.g. {next(iter(self.modules))})")
        self.amax, self.done, self.scales = {}, set(), {}

    def start(self, register: Callable[[torch.utils.hooks.RemovableHandle], None]) -> None:
        """Observe the keys and values of every layer still to calibrate; ``register`` keeps the handles (the
        lifecycle removes them)."""
        for name, module in self.modules.items():
            if name not in self.done:
                register(attention_state(module).observe(lambda kind, states, n=name: self._see(n, kind, states)))

    def _see(self, name: str, kind: str, states: torch.Tensor) -> None:
        if name in self.done or (kind not in KINDS and not (kind == "query" and name in self.query_names)):
            return
        amax = kv_amax(states, self.args.strategy)
        seen = self.amax.setdefault(name, {})
        seen[kind] = amax if kind not in seen else torch.maximum(seen[kind], amax)

    def pending(self, modules: list[str] | None) -> bool:
        """Is a layer of ``modules`` (``None``: any) still to calibrate? Its piece then needs whole forwards."""
        return any(name not in self.done and (modules is None or _in_piece(name, modules)) for name in self.modules)

    def stop_points(self, modules: list[str]) -> set[str] | None:
        """The modules whose inputs come after every pending attention layer of ``modules`` computed its keys and
        values: each one's output projection (its one Linear besides q/k/v). An observing forward may stop
        there (the MLP after it is not needed to calibrate the cache); ``None`` where a layer has no such
        projection (the whole forward then runs)."""
        stops = set()
        for name, module in self.modules.items():
            if name in self.done or not _in_piece(name, modules):
                continue
            outputs = [child for child, layer in module.named_children()
                       if isinstance(layer, torch.nn.Linear) and child not in PROJECTIONS]
            if len(outputs) != 1:
                return None
            stops.add(f"{name}.{outputs[0]}" if name else outputs[0])
        return stops

    def reduce(self, reducer: Reducer, modules: list[str] | None) -> None:
        """Every rank ends with the largest magnitudes any rank saw."""
        for name in sorted(self.modules):
            if name in self.done or (modules is not None and not _in_piece(name, modules)):
                continue
            states = [s for s in reducer.gather(self.amax.get(name)) if s]
            if states:
                self.amax[name] = {kind: torch.stack([s[kind].cpu() for s in states]).amax(0) for kind in states[0]}

    @torch.no_grad()
    def finish(self, modules: list[str] | None) -> None:
        """Set the scales of the layers of ``modules`` (``None``: all left): from now on they compute with FP8
        keys and values."""
        for name, module in self.modules.items():
            if name in self.done or (modules is not None and not _in_piece(name, modules)):
                continue
            seen = self.amax.pop(name, {})
            kinds = (*KINDS, "query") if name in self.query_names else KINDS
            if set(seen) != set(kinds):
                raise RecipeError(f"{self.owner}.kv_cache_scheme: attention layer {name!r} saw no calibration data, "
                                  f"so its KV cache scales cannot be calibrated; give data that reaches it (an "
                                  f"image-reading layer needs image samples) or add it to ignore (it then gets "
                                  f"no KV cache scales)")
            dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
            self._set(name, {SCALES[kind]: kv_scale(seen[kind], dtype).cpu() for kind in kinds})

    def restore(self, scales: dict[str, dict[str, torch.Tensor]]) -> None:
        """Put back the scales of layers a resumed run calibrated before it was interrupted."""
        for name, by_buffer in scales.items():
            if name in self.modules and name not in self.done:
                self._set(name, by_buffer)

    def _set(self, name: str, by_buffer: dict[str, torch.Tensor]) -> None:
        set_attention_scales(self.modules[name], by_buffer, self.args, self.args if name in self.query_names else None)
        self.scales[name] = dict(by_buffer)
        self.done.add(name)


def _in_piece(name: str, modules: list[str]) -> bool:
    return any(name == m or name.startswith(m + ".") or m == "" for m in modules)


def _attention_names(patch: ModelPatch | None) -> tuple[str, ...]:
    return tuple(getattr(patch, "attention_modules", ()) or ())


def attention_layers(state: CompressionState) -> dict[str, torch.nn.Module]:
    """The model's attention layers: those its patch's ``attention_modules`` name, else the default rule's (before
    any ignore entry: a weight quantizer tells an entry naming them from one that keeps nothing out)."""
    return find_attention_modules(state.model, _attention_names(state.model_patch))
