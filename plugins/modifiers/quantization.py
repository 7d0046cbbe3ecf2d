"""Round-to-nearest quantization of weights, and of layer inputs when the scheme says so.

Each targeted module's weight gets a scale / zero point from an observer
(min-max by default) and is replaced by its fake-quantized values; the saver
packs it into the compressed-tensors format. Under a layer-by-layer pipeline the
modules of each piece are quantized as soon as that piece was calibrated.

A scheme with ``input_activations`` (``W8A8``, ``FP8_DYNAMIC`` ...) also makes each quantized
layer fake-quantize its input from then on, so every later piece calibrates on the quantized
model's activations. Dynamic activations need no data; static ones (``W8A8_STATIC``, ``FP8``)
calibrate one input scale per layer with the args' observer, so the modifier then needs data.

``kv_cache_scheme`` (llm-compressor's field) also calibrates an FP8 KV cache: static FP8 E4M3 scales for
the keys and values of every attention layer, per layer or per head (:mod:`.kv_cache`); ``scheme: null``
with it quantizes the KV cache only.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from layerwise.plugin import (
    DEFAULT_IGNORE,
    CompressionState,
    ForeignField,
    ForeignFieldWarning,
    Modifier,
    RecipeError,
    RecipeNameError,
    block_entries,
    find_modules,
    has_weight,
    inside_pattern,
    layers_within,
    matches,
    registry,
    unmatched,
    warn_block_ignore,
    warn_unmatched_ignore,
    warn_user,
)
from layerwise.plugin.calibration import Reducer
from layerwise.plugin.quantization import (
    DEFAULT_TARGETS,
    Observer,
    QuantizationArgs,
    QuantizationScheme,
    compute_qparams,
    fused_sets,
    global_scales,
    is_transposed,
    kv_cache_args,
    linear_weight,
    nvfp4_global_scale,
    preset_targets,
    read_config_groups,
    recipe_observer,
    resolve_scheme,
    set_input_quantization,
    set_quantized_weight,
    split_observers,
    weight_qparams,
)

from . import llm_compressor
from .kv_cache import KVCacheCalibration, attention_layers


class Unwritten(str):
    """A field's default, told apart (``is``) from the same value written in a recipe: a default may yield
    where a written value may not (the scheme to a KV-cache-only modifier, GPTQ's actorder to the scheme's)."""


#: ``W4A16``, unless the modifier only sets a KV cache (see ``QuantizationModifier._only_kv_cache``)
DEFAULT_SCHEME = Unwritten("W4A16")
OUTPUT_OBSERVER = llm_compressor.QUANTIZATION["output_observer"]


@dataclass
class QuantizationModifier(Modifier):
    """Quantize the weights of ``targets`` (minus ``ignore``) with ``scheme``.

    ``scheme`` is a preset name (``W4A16``, ``W8A8``, ``FP8_DYNAMIC`` ...), a mapping of
    :class:`~layerwise.algorithms.quantization.args.QuantizationArgs` fields (or ``weights`` /
    ``input_activations`` mappings), or a scheme object. ``num_bits`` / ``symmetric`` /
    ``strategy`` / ``group_size`` / ``observer``, when given, override the scheme's weight args.
    ``input_observer`` overrides the observer of calibrated (static) input scales. Both read llm-compressor's
    names too (:func:`~layerwise.algorithms.quantization.config_groups.recipe_observer`: its ``minmax`` moves an
    activation range by 1 % per batch, ``static_minmax`` keeps the widest); llm-compressor's ``weight_observer``
    is ``observer``, and its ``observer: {weights: ..., input: ...}`` sets both.
    ``config_groups`` (llm-compressor's form: one group, a mapping or compressed-tensors'
    ``QuantizationScheme``) gives the scheme and targets instead; several groups are several
    modifiers, which a recipe mapping builds: ``{"QuantizationModifier": {"config_groups": ...}}``.
    ``kv_cache_scheme`` (``fp8``, ``fp8_head`` or a mapping ``{num_bits: 8, type: float, strategy: tensor |
    attn_head}``) calibrates static FP8 scales for every attention layer's keys and values; with
    ``scheme: null``, or no scheme nor weight field written (as in llm-compressor), only the KV cache is
    quantized. ``attention_scheme`` (the same values, with ``scheme: null``; llm-compressor's config group with ``input_activations`` targeting the attention
    modules) is FP8 attention: the queries of the attention layers ``targets`` names (default: all) too.
    """

    foreign_fields: ClassVar[dict[str, ForeignField]] = llm_compressor.QUANTIZATION
    max_config_groups: ClassVar[int | None] = None

    scheme: Any = DEFAULT_SCHEME
    targets: list[str] = field(default_factory=lambda: ["Linear"])
    ignore: list[str] = field(default_factory=lambda: ["lm_head"])
    num_bits: int | None = None
    symmetric: bool | None = None
    strategy: str | None = None
    group_size: int | None = None
    observer: Any = None
    input_observer: str | None = None
    config_groups: Any = None
    kv_cache_scheme: Any = None
    attention_scheme: Any = None

    block_reason: ClassVar[str] = ("calibrates the KV cache on each whole block before the block's outputs, "
                                   "computed with it, go on")

    @property
    def needs_uncompressed_block(self) -> bool:  # type: ignore[override]
        """A KV cache's scales come from a whole block's keys and values before the block runs again with
        them (the blocks cut; the layer cut would pass on outputs computed without them)."""
        return self._kv is not None

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        if self.config_groups is not None:
            self._take_config_group()
        self._take_preset_targets(owner)
        self._split_observers(owner)
        self.targets, self.ignore = target_lists(owner, self.targets, self.ignore)
        if self.scheme is DEFAULT_SCHEME:
            self.scheme = None if self._only_kv_cache() else str(DEFAULT_SCHEME)
        self._kv = self._kv_cache(owner)
        if self.scheme is None and (self._kv is None or type(self) is not QuantizationModifier):
            raise RecipeError(f"{owner}.scheme is null: give a scheme (e.g. W4A16)" + (
                "" if type(self) is not QuantizationModifier else
                ", or a kv_cache_scheme to quantize only the KV cache"))
        # fail at recipe time, not mid-run
        self.args: QuantizationArgs | None = None if self.scheme is None else self.resolve_args()
        self.input_args: QuantizationArgs | None = None if self.scheme is None else self.resolve_input_args()
        self._check_observers(owner)
        self._modules: dict[str, torch.nn.Module] = {}
        self._done: set[str] = set()
        self._observer: Any = None
        self._input_observers: dict[str, Any] = {}
        self._global_scales: dict[str, torch.Tensor] = {}
        self._fused: tuple[tuple[str, ...], ...] = fused_sets()

    def _only_kv_cache(self) -> bool:
        """A QuantizationModifier given a KV cache (or FP8 attention) and no scheme nor weight field quantizes
        only that, as llm-compressor's does (its scheme-less config group has no weights)."""
        weight_fields = (self.num_bits, self.symmetric, self.strategy, self.group_size, self.observer)
        return (type(self) is QuantizationModifier and all(value is None for value in weight_fields)
                and (self.kv_cache_scheme is not None or self.attention_scheme is not None))

    @property
    def requires_data(self) -> bool:  # type: ignore[override]
        """Only calibrated input scales (static ones, NVFP4's global one) need data; weights and dynamic inputs
        do not."""
        return (self.input_args is not None and self.input_args.calibrated) or self._kv is not None

    @property
    def kv_calibration(self) -> KVCacheCalibration | None:
        """The KV cache this modifier calibrates (``kv_cache_scheme`` / ``attention_scheme``), if any: what
        ``layerwise plan`` reports."""
        return self._kv

    # -- configuration -----------------------------------------------------------------
    def _kv_cache(self, owner: str) -> KVCacheCalibration | None:
        """The KV cache's calibration (``kv_cache_scheme``), with the queries too for FP8 attention
        (``attention_scheme``, whose args are the KV cache's: compressed-tensors stores one for both)."""
        kv_args = kv_cache_args(self.kv_cache_scheme, f"{owner}.kv_cache_scheme")
        attention = kv_cache_args(self.attention_scheme, f"{owner}.attention_scheme")
        if attention is None:
            return None if kv_args is None else KVCacheCalibration(owner, kv_args)
        if kv_args is not None and kv_args != attention:
            raise RecipeError(f"{owner}: attention_scheme and kv_cache_scheme differ; FP8 attention quantizes the "
                              f"keys and values with its own args (compressed-tensors stores one scheme for "
                              f"both): leave kv_cache_scheme out or make them equal")
        if self.scheme is not None:
            raise RecipeError(f"{owner}: attention_scheme quantizes attention modules, not weights; give it with "
                              f"scheme: null (its targets select the attention layers) and quantize the weights "
                              f"with another modifier")
        targets = None if self.targets == ["Linear"] else self.targets  # the default: every attention layer
        return KVCacheCalibration(owner, attention, queries=True, query_targets=targets)

    def _take_config_group(self) -> None:
        """One config group given to the constructor becomes this modifier's scheme and targets."""
        owner = type(self).__name__
        groups = read_config_groups(self.config_groups, f"{owner}.config_groups")
        if len(groups) > 1:
            raise RecipeError(f"{owner}(config_groups=...) got {len(groups)} groups; one {owner} object holds one "
                              f"scheme: pass the recipe as a mapping, compress(model, {{'{owner}': "
                              f"{{'config_groups': ..., 'ignore': [...]}}}}), which builds one modifier per group, "
                              f"or build one {owner} per group")
        defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                    for f in dataclasses.fields(type(self)) if f.name in ("scheme", "targets")}
        given = [name for name in ("scheme", "targets") if getattr(self, name) != defaults[name]]
        if given:
            raise RecipeError(f"{owner}: give config_groups or {' and '.join(given)}, not both: a config group "
                              f"carries its own scheme and targets")
        (group,) = groups
        self.scheme, self.targets, self.config_groups = group.scheme, list(group.targets), None
        if group.attention is not None:
            self.attention_scheme = group.attention.to_dict()

    def _take_preset_targets(self, owner: str) -> None:
        """llm-compressor's ``scheme: {preset: targets}`` given to the constructor: one preset becomes this
        modifier's scheme and targets (a recipe mapping builds one modifier per preset)."""
        presets = preset_targets(self.scheme, f"{owner}.scheme")
        if presets is None:
            return
        if len(presets) > 1:
            raise RecipeError(f"{owner}(scheme={{...}}) got {len(presets)} presets; one {owner} object holds one "
                              f"scheme: pass the recipe as a mapping, compress(model, {{'{owner}': {{'scheme': "
                              f"{{...}}, 'ignore': [...]}}}}), which builds one modifier per preset, or build one "
                              f"{owner} per preset")
        if self.targets not in DEFAULT_TARGETS:
            raise RecipeError(f"{owner}: with scheme {{preset: targets}} the targets go in the mapping; the "
                              f"modifier's own targets field would be a second list (llm-compressor ignores it)")
        ((self.scheme, self.targets),) = presets

    def _split_observers(self, owner: str) -> None:
        """llm-compressor's ``observer: {weights: ..., input: ..., output: ...}`` as this modifier's ``observer``
        and ``input_observer`` (the names as written: they are read when the args are resolved)."""
        self.observer, self.input_observer, output = split_observers(self.observer, self.input_observer, owner)
        if output is not None:
            warn_user(f"{owner}.observer.output is ignored: {OUTPUT_OBSERVER.note}", ForeignFieldWarning)

    def resolve_input_args(self) -> QuantizationArgs | None:
        """The input args: the scheme's, with ``input_observer`` applied where a scale is calibrated (as in
        llm-compressor, it changes nothing where the inputs are not quantized or their scales are dynamic)."""
        args = resolve_scheme(self.scheme).input_activations
        if self.input_observer is None:
            return args
        where = f"{type(self).__name__}.input_observer"
        observer = recipe_observer(self.input_observer, "input_activations", where)
        if args is None or not args.calibrated:
            warn_user(f"{where} {self.input_observer!r} is ignored: the scheme "
                      f"{'quantizes no layer inputs' if args is None else 'computes input scales from each input'}"
                      f", so there is no input range to calibrate", ForeignFieldWarning)
            return args
        return args.replace(observer=observer)

    def _check_observers(self, owner: str) -> None:
        """Every observer the args name is registered: an unknown one fails here, not once the model is loaded."""
        valid = registry("observers").names()
        for name, args in (("observer", self.args), ("input_observer", self.input_args)):
            if args is not None and args.observer not in valid:
                raise RecipeNameError("observer", args.observer, valid, hint=(
                    f"It comes from {owner}.{name} or the scheme; llm-compressor's static_minmax, "
                    f"memoryless_minmax and memoryless_mse are read too"))

    def resolve_args(self) -> QuantizationArgs:
        """The weight args: the scheme's, with this modifier's explicit overrides applied."""
        scheme: QuantizationScheme = resolve_scheme(self.scheme)
        overrides = {name: getattr(self, name)
                     for name in ("num_bits", "symmetric", "strategy", "group_size", "observer")
                     if getattr(self, name) is not None}
        if "observer" in overrides:
            overrides["observer"] = recipe_observer(self.observer, "weights", f"{type(self).__name__}.observer")
        if not overrides:
            return scheme.weights
        try:
            args = scheme.weights.replace(**overrides)
        except TypeError as exc:
            raise RecipeError(str(exc)) from None
        args.check_for("weights")
        if "group_size" in overrides and args.effective_group_size is None:
            raise RecipeError(f"{type(self).__name__}.group_size {self.group_size} has no effect with strategy "
                              f"{args.strategy!r} (the scheme's{' override' if self.strategy else ''}): add strategy: "
                              f"group for groups of {self.group_size}, or drop group_size")
        return args

    def resolve_modules(self, state: CompressionState) -> dict[str, torch.nn.Module]:
        """The modules to quantize; errors for a target matching nothing or an indivisible group."""
        if self.args is None:  # scheme: null, the KV cache only
            return {}
        # an ignore entry naming attention layers keeps their KV scales out
        attention = set(attention_layers(state)) if self._kv is not None else None
        modules = targeted_modules(type(self).__name__, state, self.targets, self.ignore, attention=attention)
        if self.input_args is not None:
            transposed = next((name for name, module in modules.items() if is_transposed(module)), None)
            if transposed:
                raise RecipeError(f"{type(self).__name__}: layer {transposed!r} is a transformers Conv1D (GPT-2 "
                                  f"style): input-activation quantization is for nn.Linear layers only; use a "
                                  f"weight-only scheme (W4A16, W8A16) or add it to ignore")
        check_float_format(type(self).__name__, self.args, modules)
        inputs = self.input_args
        if inputs is not None and inputs.strategy == "group":
            for name, module in modules.items():
                if linear_weight(module).shape[-1] % inputs.group_size:
                    raise RecipeError(f"{type(self).__name__}: input_activations group_size {inputs.group_size} does "
                                      f"not divide the {linear_weight(module).shape[-1]} inputs of layer {name!r}; "
                                      f"add it to ignore or choose a group size that divides it")
        misfits = _indivisible(modules, self.args.group_size) if self.args.strategy == "group" and \
            self.args.float_format is None else []
        if misfits:
            name, in_features = misfits[0]
            divisors = [g for g in (32, 64, 128) if all(width % g == 0 for _, width in misfits)]
            alt = f", or group_size {divisors[-1]}" if divisors else ""
            raise RecipeError(
                f"{type(self).__name__}: group_size {self.args.group_size} does not divide "
                f"in_features {in_features} of layer {name!r}{_and_more(misfits)}; use strategy: channel{alt}, "
                f"or add {'it' if len(misfits) == 1 else 'them'} to ignore")
        return modules

    # -- events ------------------------------------------------------------------------
    def on_initialize(self, state: CompressionState) -> None:
        self._kv_scales: dict[str, dict[str, torch.Tensor]] = {}  # plain data: a resumed run's checkpoint keeps it
        self._observer = None if self.args is None else registry("observers").get(self.args.observer)(self.args)
        if self.input_args is not None:
            registry("observers").get(self.input_args.observer)  # an unknown name fails before calibrating
        self._modules = self.resolve_modules(state)
        patch = state.model_patch
        # NVFP4: the projections the run's patch declares fused share a global scale too (beside the defaults)
        self._fused = fused_sets(patch.shared_scale_sets() if patch is not None else ())
        if self._kv is not None:  # after the weights' checks: routing the attention layers is the last step
            self._kv.resolve(state, self.ignore)
        self._done = set()
        self._input_observers = {}

    def on_calibration_start(self, state: CompressionState) -> None:
        self._observe_inputs()
        self.observe_kv_cache()

    def observe_kv_cache(self) -> None:
        """With a kv_cache_scheme: observe the keys and values of the attention layers still to calibrate."""
        if self._kv is not None:
            self._kv.start(self._hooks.append)

    def calibration_inputs(self, modules: list[str]) -> set[str] | None:
        """Static input scales read the inputs of the layers still to be quantized; otherwise nothing. An
        attention layer whose KV cache is still to calibrate needs whole forwards (its keys after the rotary
        embedding)."""
        stops: set[str] = set()
        if self._kv is not None and self._kv.pending(modules):
            found = self._kv.stop_points(modules)  # an observing forward may end at the output projections
            if found is None:
                return None
            stops = found
        if self.input_args is None or not self.input_args.calibrated:
            return stops
        return stops | {name for name in self._modules if name not in self._done and _in_piece(name, modules)}

    def _observe_inputs(self) -> None:
        """Static input scales: one observer per layer, fed by a pre-hook until the layer is quantized."""
        if self.input_args is None or not self.input_args.calibrated:
            return
        observer_cls = registry("observers").get(self.input_args.observer)
        for name, module in self._modules.items():
            self._input_observers[name] = observer_cls(self.input_args)
            self.register_hook(module, lambda m, args, n=name: self._observe_input(n, args), "forward_pre")

    def _observe_input(self, name: str, args: tuple) -> None:
        observer = self._input_observers.get(name)
        if observer is not None and args and isinstance(args[0], torch.Tensor):
            observer.update(args[0])

    def on_reduce(self, state: CompressionState, reducer: Reducer, modules: list[str] | None) -> None:
        """Static input scales: merge each layer's input observer over the ranks (:meth:`Observer.reduce`)."""
        for name, observer in self._input_observers.items():
            if name not in self._done and (modules is None or _in_piece(name, modules)):
                observer.reduce(reducer)
        if self._kv is not None:
            self._kv.reduce(reducer, modules)

    def on_sequential_epoch_end(self, state: CompressionState, modules: list[str]) -> None:
        names = [name for name in self._modules if name not in self._done and _in_piece(name, modules)]
        self.prepare_global_scales(names)
        for name in names:
            self.quantize_module(name, self._modules[name])
        self.finish_kv_cache(modules)

    def on_calibration_end(self, state: CompressionState) -> None:
        names = [name for name in self._modules if name not in self._done]
        self.prepare_global_scales(names)
        for name in names:
            self.quantize_module(name, self._modules[name])
        self.finish_kv_cache(None)

    def finish_kv_cache(self, modules: list[str] | None) -> None:
        """With a kv_cache_scheme: set the KV scales of the attention layers of ``modules`` (``None``: all left)."""
        if self._kv is not None:
            self._kv.restore(self._kv_scales)  # a resumed run: the layers calibrated before the interruption
            self._kv.finish(modules)
            self._kv_scales = dict(self._kv.scales)

    def prepare_global_scales(self, names: list[str]) -> None:
        """NVFP4: the global scales of ``names`` from their weights before any is quantized, equal across the
        projections a server fuses (q/k/v, gate/up, and the sets the run's patch declares: :meth:`~layerwise.host.model_patch.ModelPatch.shared_scale_sets`); nothing for
        other formats."""
        if not names:
            return
        weights = {name: linear_weight(self._modules[name]).detach() for name in names}
        self._global_scales.update(global_scales(weights, self.args, self._fused))

    # -- work --------------------------------------------------------------------------
    @torch.no_grad()
    def quantize_module(self, name: str, module: torch.nn.Module) -> None:
        """Round-to-nearest: observe the weight, compute qparams, store the fake-quantized weight.

        With a min-max observer the weight is read in its own dtype (its minima and maxima are exact in any
        float dtype, and quantizing divides by the float32 scale a slice at a time): the same values as a
        float32 copy of the weight, without making one. Another observer gets the float32 copy."""
        weight = linear_weight(module).detach()
        kind = type(self._observer)
        min_max = self._observer is None or (kind.reduce_weight is Observer.reduce_weight
                                             and kind.__call__ is Observer.__call__)
        if not min_max or weight.dtype == torch.float64:
            weight = weight.to(torch.float32)
        global_scale = self._global_scales.pop(name, None)
        if global_scale is None and self.args.float_format == "nvfp4":
            global_scale = global_scales({name: weight}, self.args)[name]
        observer = self._observer
        if min_max:  # the range in float32 whatever the weight's dtype: the qparams are computed in float32
            observer = functools.partial(_float32_range, self._observer or Observer(self.args))
        scale, zero_point = weight_qparams(weight, self.args, observer, global_scale)
        set_quantized_weight(module, weight, scale, zero_point, self.args, global_scale=global_scale)
        self.quantize_inputs(name, module)
        self._done.add(name)

    def quantize_inputs(self, name: str, module: torch.nn.Module) -> None:
        """After the weight: make the layer quantize its input as the scheme says (calibrated scale if static)."""
        if self.input_args is None:
            return
        if not self.input_args.calibrated:
            set_input_quantization(module, self.input_args)
            return
        observer = self._input_observers.pop(name, None)
        if observer is None or observer.batches == 0:
            raise RecipeError(f"{type(self).__name__}: layer {name!r} saw no calibration data, so its static input "
                              f"scale cannot be calibrated; give data that reaches it, add it to ignore, or use a "
                              f"dynamic scheme (W8A8, FP8_DYNAMIC)")
        if self.input_args.strategy == "tensor_group":  # NVFP4: the global input scale from the widest range seen
            low, high = observer.result()
            amax = torch.maximum(low.abs(), high.abs()).amax()
            set_input_quantization(module, self.input_args, global_scale=nvfp4_global_scale(amax))
            return
        scale, zero_point = compute_qparams(*observer.result(), self.input_args)
        set_input_quantization(module, self.input_args, scale, zero_point)

    def to_dict(self) -> dict[str, Any]:
        """The recipe entry, leaving out overrides that were not given."""
        ((name, fields),) = super().to_dict().items()
        unset = {f.name for f in dataclasses.fields(self) if f.default is None and getattr(self, f.name) is None}
        return {name: {k: v for k, v in fields.items() if k not in unset}}


def _float32_range(observer: Observer, weight: torch.Tensor,
                   global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``observer``'s range of ``weight`` in float32 (exact: minima and maxima are values of the weight)."""
    low, high = observer(weight, global_scale)
    return low.to(torch.float32), high.to(torch.float32)


def check_float_format(owner: str, args: QuantizationArgs, modules: dict[str, torch.nn.Module]) -> None:
    """The low-bit float formats (NVFP4, MXFP4, MXFP8) scale fixed blocks of input columns of nn.Linear
    weights: a width the block does not divide, or a transformers Conv1D, is an error naming the layer."""
    if args.float_format is None:
        return
    fmt = args.float_format.upper()
    for name, module in modules.items():
        if is_transposed(module):
            raise RecipeError(f"{owner}: layer {name!r} is a transformers Conv1D (GPT-2 style); {fmt} block scales "
                              f"are stored for nn.Linear weights only (compressed-tensors and vLLM); add it to "
                              f"ignore or use an integer scheme (W4A16)")
    misfits = _indivisible(modules, args.group_size)
    if misfits:
        name, in_features = misfits[0]
        raise RecipeError(f"{owner}: {fmt} scales blocks of {args.group_size} input columns; layer {name!r} has "
                          f"{in_features}, not a multiple of {args.group_size}{_and_more(misfits)}: add "
                          f"{'it' if len(misfits) == 1 else 'them'} to ignore (the block size is part of the format "
                          f"and cannot change)")


def _indivisible(modules: dict[str, torch.nn.Module], size: int) -> list[tuple[str, int]]:
    """The layers whose input width ``size`` does not divide, with that width: all of them, so that one
    error names every layer to ignore (not one per run)."""
    widths = ((name, linear_weight(module).shape[-1]) for name, module in modules.items())
    return [(name, width) for name, width in widths if width % size]


def _and_more(misfits: list[tuple[str, int]]) -> str:
    """`` (and 13 more: 'a', 'b', ...)`` after the first of ``misfits``; nothing when it is alone."""
    rest = [name for name, _ in misfits[1:]]
    if not rest:
        return ""
    shown = ", ".join(map(repr, rest[:5])) + (", ..." if len(rest) > 5 else "")
    return f" (and {len(rest)} more: {shown})"


def target_lists(owner: str, targets: Any, ignore: Any) -> tuple[list[str], list[str]]:
    """A modifier's ``targets`` and ``ignore`` as lists (a single string allowed); empty targets are an error."""
    targets = [targets] if isinstance(targets, str) else list(targets or [])
    ignore = [ignore] if isinstance(ignore, str) else list(ignore or [])
    if not targets:
        raise RecipeError(f"{owner}.targets is empty; e.g. targets: [Linear]")
    return targets, ignore


def targeted_modules(owner: str, state: CompressionState, targets: list[str], ignore: list[str], *,
                     within: bool = False, attention: set[str] | None = None) -> dict[str, torch.nn.Module]:
    """The modules with a weight that ``targets`` select minus ``ignore`` and the run's ignore list;
    a target matching nothing is an error listing what the model has. ``within`` (the pruners, as
    llm-compressor's): a selected module without a weight (a block) stands for the Linear layers inside it.
    ``attention``: the KV cache's attention layers, which an ignore entry matching only them keeps out of the
    KV cache (not warned about as an entry that matches only blocks)."""
    model = state.model
    missing = unmatched(model, targets)
    if missing:
        raise RecipeError(_missing_target_message(owner, missing, model))
    ignored = list(dict.fromkeys([*ignore, *(state.ignore or [])]))  # the run's list repeats the defaults
    selected = find_modules(model, targets)
    if within:
        selected = layers_within(model, selected)
    unmatched_ignore = unmatched(model, [entry for entry in ignore if entry not in DEFAULT_IGNORE])  # lm_head: no walk
    if unmatched_ignore:  # the names for the hint only then: a 256-expert model has 60,000 modules to list
        warn_unmatched_ignore(owner, unmatched_ignore, [n for n, _ in model.named_modules() if n],
                              f"module of {type(model).__name__}")
    blocks = block_entries(model, ignore)
    warn_block_ignore(owner, {entry: names for entry, names in blocks.items()
                              if not (attention and set(names) <= attention)})
    weighted = {n: m for n, m in selected.items() if has_weight(m)}
    found = {n: m for n, m in weighted.items() if not matches(n, m, ignored)}
    if found or not selected:
        return found
    if not weighted:
        raise RecipeError(_blocks_message(owner, targets, selected))
    raise RecipeError(f"{owner}: every layer its targets {list(targets)} select is ignored (ignore {ignored}), so "
                      f"it would compress nothing: drop or narrow an ignore entry (recipe ignore:, CLI --ignore)")


def _blocks_message(owner: str, targets: list[str], selected: dict[str, torch.nn.Module]) -> str:
    """Targets that select only blocks: say so (not that everything is ignored), with what they select and each
    target rewritten to select the layers inside (``re:`` entries match the whole name, unlike
    llm-compressor's, which match its start)."""
    kinds = sorted({type(module).__name__ for module in selected.values()})
    names = list(selected)
    shown = ", ".join(map(repr, names[:3])) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
    fixes = ", ".join(f"{target!r} -> '{inside_pattern(target)}'" for target in targets)
    return (f"{owner}: these targets select modules without a weight (blocks): {list(targets)} select {shown} "
            f"({', '.join(kinds)}), which hold no weight to compress: use Linear or the layers inside ({fixes}; "
            f"an 're:' entry matches the whole qualified name)")


def _in_piece(name: str, modules: list[str]) -> bool:
    return any(name == m or name.startswith(m + ".") or m == "" for m in modules)


def _missing_target_message(owner: str, missing: list[str], model: torch.nn.Module) -> str:
    classes = sorted({type(m).__name__ for m in model.modules()})
    linears = [n for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) or type(m).__name__ == "Conv1D"]
    shown = ", ".join(linears[:6]) + (f", ... ({len(linears)} in all)" if len(linears) > 6 else "")
    return (f"{owner}: target(s) {', '.join(map(repr, missing))} match no module of "
            f"{type(model).__name__}; module classes in the model: {', '.join(classes)}; "
            f"Linear layers: {shown or '(none)'}. Targets are class names, qualified names "
            f"or 're:<regex>' patterns")
