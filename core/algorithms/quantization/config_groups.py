"""llm-compressor's ``config_groups`` as layerwise schemes.

A ``QuantizationModifier`` / ``GPTQModifier`` recipe written for llm-compressor may describe its
quantization as compressed-tensors ``QuantizationScheme`` mappings instead of a preset::

    config_groups:
      group_0:
        targets: [Linear]
        weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 128}
        input_activations: null
        output_activations: null

:func:`read_config_groups` turns each group into a :class:`~layerwise.algorithms.quantization.args.QuantizationScheme`
with compressed-tensors' defaults and inference rules (``num_bits`` 8, symmetric, the strategy from
``group_size``: none -> ``tensor``, > 0 -> ``group``, -1 -> ``channel``; ``actorder: weight`` is
layerwise's ``static``; NVFP4 / MXFP4 / MXFP8 weights with their ``scale_dtype``). What layerwise
cannot express (output activations, observer arguments, other scale dtypes, imatrix observers, ...) is a
:class:`~layerwise.errors.RecipeError`
naming the field, where it is, and the nearest thing layerwise does. A group's ``format`` is
ignored with a warning: the saver picks the storage format from the scheme, as llm-compressor
infers it.

A group with ``input_activations`` and no ``weights`` whose targets are attention modules is FP8
attention (llm-compressor 0.14's form: ``targets: [LlamaAttention]``, static FP8 ``tensor`` or
``attn_head`` args): its queries, keys and values are quantized (``ConfigGroup.attention``; see
:mod:`.kv_cache`).

Where two groups' targets match one layer, compressed-tensors quantizes it with the more specific
target (a qualified name, then a ``re:`` pattern, then a class name); :func:`exclusive_ignores`
gives each group the other groups' targets to leave out so that the same holds (between two groups
equally specific, the first one listed wins).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from layerwise.algorithms.quantization.args import (
    BITS,
    QuantizationArgs,
    QuantizationScheme,
    recipe_actorder,
)
from layerwise.common.user_warnings import warn_user
from layerwise.errors import RecipeError, did_you_mean, unknown_names

#: the fields of a compressed-tensors QuantizationScheme (one config group)
GROUP_FIELDS = ("targets", "weights", "input_activations", "output_activations", "format")
#: the fields of a compressed-tensors QuantizationArgs
ARGS_FIELDS = ("num_bits", "type", "symmetric", "group_size", "strategy", "block_structure", "dynamic", "actorder",
               "scale_dtype", "zp_dtype", "observer", "observer_kwargs")
#: compressed-tensors / llm-compressor observer names -> layerwise's, for (weights, static activations).
#: llm-compressor's ``minmax`` moves the activation range by a constant per batch; ``static_minmax`` keeps
#: the widest range seen. A weight is observed once, so every min-max flavour is ``minmax`` there.
OBSERVERS = {
    "minmax": ("minmax", "moving_average_minmax"),
    "static_minmax": ("minmax", "minmax"),
    "memoryless_minmax": ("minmax", "minmax"),
    "memoryless": ("minmax", "minmax"),
    "moving_average_minmax": ("minmax", "moving_average_minmax"),
    "mse": ("mse", "mse"),
    "memoryless_mse": ("mse", "mse"),
}
#: llm-compressor 0.14's observers layerwise has no counterpart for -> what to write instead
MISSING_OBSERVERS = {
    "imatrix_mse": "its clipping search weighs each input column by the mean square of the inputs it sees; "
                   "layerwise's mse weighs every column alike; nearest: observer mse, or GPTQModifier / "
                   "AWQModifier, which fit the weights to the calibration inputs",
    "nvfp4_expanded_imatrix": "its NVFP4 range search (ranges above the observed one, weighted by the inputs) "
                              "has no layerwise counterpart; nearest: observer mse",
    "nvfp4_expanded_mse": "its NVFP4 range search also tries ranges above the observed one; layerwise's mse "
                          "searches from the observed range down; nearest: observer mse",
    "fouroversix": "llm-compressor's other name for nvfp4_expanded_mse (a search above the observed range), "
                   "which layerwise has no counterpart for; nearest: observer mse",
}
#: how specific a target is, compressed-tensors' order: a qualified name, a ``re:`` pattern, a class name
_EXACT, _REGEX, _CLASS = 0, 1, 2


class ConfigGroupWarning(UserWarning):
    """A config-group field layerwise reads and ignores (the message says why)."""


@dataclass(frozen=True)
class ConfigGroup:
    """One config group: its name, its targets and the layerwise scheme it maps to."""

    name: str
    targets: tuple[str, ...]
    #: the weights' scheme; ``None`` for an FP8 attention group
    scheme: QuantizationScheme | None
    #: FP8 attention (queries, keys and values) of the targeted attention modules
    attention: QuantizationArgs | None = None


def read_config_groups(groups: Any, where: str) -> list[ConfigGroup]:
    """The config groups of a recipe, each as a layerwise scheme; ``where`` names the field in errors.

    A group may be a mapping or compressed-tensors' own ``QuantizationScheme`` object (as llm-compressor
    scripts build them): it is read through its plain form."""
    groups = plain(groups)
    if isinstance(groups, Mapping):
        groups = {name: plain(group) for name, group in groups.items()}
    if not isinstance(groups, Mapping) or not groups:
        raise RecipeError(f"{where}: config_groups is a mapping of group names to schemes, e.g. "
                          f"{{group_0: {{targets: [Linear], weights: {{num_bits: 4, group_size: 128}}}}}}; got {groups!r}")
    return [_group(str(name), group, f"{where}.{name}") for name, group in groups.items()]


def plain(value: Any) -> Any:
    """A pydantic object (compressed-tensors' QuantizationScheme / QuantizationArgs) as the mapping it
    saves as, without its unset (None) fields; anything else as it is."""
    dump = getattr(value, "model_dump", None)
    return dump(mode="json", exclude_none=True) if callable(dump) else value


def _group(name: str, group: Any, where: str) -> ConfigGroup:
    if not isinstance(group, Mapping):
        raise RecipeError(f"{where}: a config group is a mapping with targets and weights, got {group!r}")
    unknown = [k for k in group if k not in GROUP_FIELDS]
    if unknown:
        raise RecipeError(f"{where}: unknown config-group field(s) {unknown_names(unknown, GROUP_FIELDS)}; valid fields: "
                          f"{', '.join(GROUP_FIELDS)}")
    targets = group.get("targets")
    targets = [targets] if isinstance(targets, str) else targets
    if not targets or not all(isinstance(t, str) for t in targets):
        raise RecipeError(f"{where}.targets: give the layers this group quantizes, e.g. targets: [Linear]; got "
                          f"{group.get('targets')!r}")
    if group.get("output_activations") is not None:
        raise RecipeError(f"{where}.output_activations: layerwise quantizes weights and layer inputs only, not "
                          f"outputs; nearest: input_activations (the next layer quantizes what this one produces), "
                          f"or leave output_activations out")
    inputs = plain(group.get("input_activations"))
    if group.get("weights") is None and isinstance(inputs, Mapping) and _static_float8(inputs):
        from layerwise.algorithms.quantization.kv_cache import kv_cache_args

        return ConfigGroup(name, tuple(targets), None,
                           attention=kv_cache_args(plain(group["input_activations"]), f"{where}.input_activations"))
    if group.get("weights") is None:
        raise RecipeError(f"{where}.weights: layerwise quantizes weights, with or without the inputs; a group "
                          f"without weights (activations only) is read as FP8 attention only (static float8 "
                          f"input_activations, targets: [LlamaAttention]); else add weights, e.g. "
                          f"weights: {{num_bits: 8, strategy: channel}} (W8A8)")
    if group.get("format") is not None:
        warn_user(f"{where}.format {group['format']!r} is ignored: layerwise stores each scheme in the format "
                  f"compressed-tensors infers for it (pack-quantized, int-quantized or float-quantized)",
                  ConfigGroupWarning)
    weights = ct_args(group["weights"], f"{where}.weights", "weights")
    inputs = group.get("input_activations")
    activations = None if inputs is None else ct_args(inputs, f"{where}.input_activations", "input_activations")
    try:
        scheme = QuantizationScheme(weights, tuple(targets), activations)
    except RecipeError as exc:
        raise RecipeError(f"{where}: {exc}") from None
    return ConfigGroup(name, tuple(targets), scheme)


def _static_float8(inputs: Mapping) -> bool:
    """Static FP8 inputs: what an FP8 attention group quantizes its queries, keys and values with."""
    return str(inputs.get("type", "int")).lower() == "float" and inputs.get("num_bits", 8) == 8 and not inputs.get(
        "dynamic", False)


def ct_args(data: Any, where: str, role: str) -> QuantizationArgs:
    """compressed-tensors QuantizationArgs fields (weights or input activations) as layerwise's args."""
    if not isinstance(data, Mapping):
        raise RecipeError(f"{where}: quantization args are a mapping (num_bits, type, symmetric, strategy, "
                          f"group_size, ...), got {data!r}")
    unknown = [k for k in data if k not in ARGS_FIELDS]
    if unknown:
        raise RecipeError(f"{where}: unknown field(s) {unknown_names(unknown, ARGS_FIELDS)}; compressed-tensors' "
                          f"quantization args are {', '.join(ARGS_FIELDS)}")
    kind = str(data.get("type", "int")).lower()
    bits = data.get("num_bits", 8)
    if isinstance(bits, str) and bits.strip().isdigit():  # "4": compressed-tensors' pydantic args read it as 4
        bits = int(bits)
    if kind not in ("int", "float"):
        raise RecipeError(f"{where}.type {data['type']!r}:{did_you_mean(kind, ('int', 'float'))} layerwise quantizes "
                          f"to int or float (float8 e4m3)")
    if kind == "float" and bits not in (4, 8):
        raise RecipeError(f"{where}: type float with num_bits {bits} cannot be expressed in layerwise; floats are "
                          f"num_bits 8 (FP8 E4M3) or 4 (FP4 E2M1: NVFP4, MXFP4)")
    if kind == "int" and bits not in BITS:
        nearest = min(BITS, key=lambda b: (abs(b - bits), -b)) if isinstance(bits, int) else 8
        raise RecipeError(f"{where}.num_bits {bits!r}: layerwise quantizes integers to "
                          f"{', '.join(map(str, BITS))} bits; nearest: num_bits: {nearest}")
    scale_dtype = data.get("scale_dtype")
    scale_dtype = None if scale_dtype is None else str(scale_dtype).removeprefix("torch.")
    if scale_dtype not in (None, "float8_e4m3fn", "uint8"):
        raise RecipeError(f"{where}.scale_dtype {data['scale_dtype']!r} cannot be chosen in layerwise: scales are stored "
                          f"in the weight's dtype, except NVFP4's (float8_e4m3fn) and the MX formats' (uint8, "
                          f"E8M0); leave it out (load the model in the dtype you want the scales in)")
    if data.get("zp_dtype") is not None and scale_dtype is None:  # the float presets name it beside scale_dtype
        raise RecipeError(f"{where}.zp_dtype {data['zp_dtype']!r} cannot be chosen in layerwise: zero points are "
                          f"stored int8 (packed into int32 for int4 weights); leave it out")
    if data.get("observer_kwargs"):
        raise RecipeError(f"{where}.observer_kwargs: layerwise's observers take no arguments; leave them out, or "
                          f"pick another observer (minmax, moving_average_minmax, mse: the clipping that "
                          f"minimises the error)")
    dynamic = data.get("dynamic", False)
    if isinstance(dynamic, str):
        # compressed-tensors' "local": NVFP4 inputs, each block's scale at run time under one calibrated global
        # scale; layerwise's NVFP4 inputs (strategy tensor_group, dynamic true) are exactly that
        if dynamic.lower() != "local" or str(data.get("strategy", "")).lower() != "tensor_group" or role == "weights":
            raise RecipeError(f"{where}.dynamic {dynamic!r}: compressed-tensors' only string is 'local', for "
                              f"input_activations with strategy tensor_group (NVFP4's per-block scales at run "
                              f"time); elsewhere write dynamic: true or false")
        dynamic = True
    if role == "weights" and dynamic:
        raise RecipeError(f"{where}.dynamic: weights are quantized once, dynamic is for input_activations; "
                          f"leave it out of weights")
    strategy = data.get("strategy")
    group_size = data.get("group_size")
    if strategy is None:  # compressed-tensors infers the strategy from the group size
        strategy = "tensor" if group_size is None else "channel" if group_size == -1 else "group"
    strategy = str(strategy).lower()
    if strategy == "attn_head":
        raise RecipeError(f"{where}.strategy {strategy!r} cannot be expressed in layerwise; nearest: strategy: channel")
    if strategy == "group" and group_size == -1:
        raise RecipeError(f"{where}: group_size -1 means one scale per channel: write strategy: channel")
    actorder = recipe_actorder(data.get("actorder"), f"{where}.actorder")
    observer = data.get("observer")
    static = role == "weights" or not dynamic
    if observer is None:
        observer = "minmax"
    else:
        observer = recipe_observer(observer, role, f"{where}.observer")
        observer = observer if static or str(data["observer"]).lower() not in OBSERVERS else "minmax"
    fields: dict[str, Any] = {"num_bits": bits, "type": kind, "symmetric": data.get("symmetric", True),
                              "strategy": strategy, "group_size": group_size if strategy in ("group", "tensor_group") else None,
                              "observer": observer, "actorder": actorder, "dynamic": bool(dynamic),
                              "scale_dtype": scale_dtype}
    if data.get("block_structure") is not None:
        block = data["block_structure"]
        if isinstance(block, str):  # compressed-tensors still reads the old "128x128"
            try:
                block = [int(x) for x in block.lower().split("x")]
            except ValueError:
                raise RecipeError(f"{where}.block_structure {block!r}: write [rows, columns]") from None
        fields["block_structure"] = tuple(block)
    try:
        args = QuantizationArgs.from_dict(fields)
        args.check_for(role)
    except RecipeError as exc:
        raise RecipeError(f"{where}: {exc}") from None
    return args


#: the keys of llm-compressor's ``observer`` mapping (the roles it names an observer for)
OBSERVER_ROLES = ("weights", "input", "output")


def split_observers(observer: Any, input_observer: Any, where: str) -> tuple[Any, Any, Any]:
    """llm-compressor's ``observer: {weights: ..., input: ..., output: ...}`` (beside ``input_observer``) as the
    observers of the weights, the inputs and the outputs, names as written; an observer that is no mapping is
    the weights' (layerwise's own field). ``where`` names the modifier in errors."""
    if not isinstance(observer, Mapping):
        return observer, input_observer, None
    unknown = [key for key in observer if key not in OBSERVER_ROLES]
    if unknown:
        raise RecipeError(f"{where}.observer: unknown key(s) {unknown_names(unknown, OBSERVER_ROLES)}; "
                          f"llm-compressor's observer mapping takes {', '.join(OBSERVER_ROLES)}")
    if input_observer is not None and observer.get("input") is not None:
        raise RecipeError(f"{where}: observer.input and input_observer are one setting; give one")
    return observer.get("weights"), observer.get("input", input_observer), observer.get("output")


def recipe_observer(name: Any, role: str, where: str) -> str:
    """The layerwise observer that does what observer ``name`` (compressed-tensors' / llm-compressor's, or a
    layerwise one) does for ``role`` (``"weights"`` or ``"input_activations"``); ``where`` names the field in
    errors. A name layerwise has no counterpart for is an error saying the nearest; any other passes as a
    layerwise observer's (the modifier checks it is registered)."""
    if not isinstance(name, str) or not name:
        raise RecipeError(f"{where}: an observer is a name (minmax, static_minmax, mse, ...), got {name!r}")
    key = name.lower()
    if key in MISSING_OBSERVERS:
        raise RecipeError(f"{where} {name!r} cannot be expressed in layerwise: {MISSING_OBSERVERS[key]}")
    return OBSERVERS[key][0 if role == "weights" else 1] if key in OBSERVERS else name


def exclusive_ignores(groups: list[ConfigGroup]) -> list[list[str]]:
    """Per group, the other groups' targets it must leave out, so that no layer is quantized twice.

    A group yields to one whose least specific target is more specific than its own (a name over a
    ``re:`` pattern over a class name), and, between equals, to the groups listed before it.
    """
    ranks = [max(_specificity(t) for t in group.targets) for group in groups]
    ignores: list[list[str]] = []
    for i, group in enumerate(groups):
        yields_to = [j for j in range(len(groups)) if j != i and (ranks[j] < ranks[i] or (ranks[j] == ranks[i] and j < i))]
        ignores.append([target for j in yields_to for target in groups[j].targets])
    return ignores


def _specificity(target: str) -> int:
    if target.startswith("re:"):
        return _REGEX
    return _CLASS if target[:1].isupper() and "." not in target else _EXACT
