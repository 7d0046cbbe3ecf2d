"""Named quantization schemes (``W4A16`` ...) and turning recipe values into schemes."""

from __future__ import annotations

import dataclasses
from typing import Any

from layerwise.algorithms.quantization.args import QuantizationArgs, QuantizationScheme
from layerwise.errors import RecipeError, UnknownNameError, did_you_mean, unknown_names

_INT8_CHANNEL = QuantizationArgs(num_bits=8, symmetric=True, strategy="channel", group_size=None)
_FP8 = dict(type="float", num_bits=8, symmetric=True, group_size=None)
#: the low-bit float weight layouts (see float_formats): NVFP4, MXFP4, MXFP8
_NVFP4 = QuantizationArgs(type="float", num_bits=4, strategy="tensor_group", group_size=16)
_MXFP4 = QuantizationArgs(type="float", num_bits=4, strategy="group", group_size=32, scale_dtype="e8m0")
_MXFP8 = QuantizationArgs(type="float", num_bits=8, strategy="group", group_size=32, scale_dtype="e8m0")

#: named schemes: ``W<bits>A16`` quantize weights only, ``W8A8`` / ``FP8*`` also the inputs of each layer
PRESETS: dict[str, QuantizationScheme] = {
    # int4, symmetric, one scale per 128 input columns of each output row
    "W4A16": QuantizationScheme(QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=128)),
    # int4, asymmetric (scale and zero point) per group of 128
    "W4A16_ASYM": QuantizationScheme(QuantizationArgs(num_bits=4, symmetric=False, strategy="group",
                                                      group_size=128)),
    # int8, symmetric, one scale per output channel
    "W8A16": QuantizationScheme(_INT8_CHANNEL),
    # int8 weights per channel, int8 inputs with a scale per token computed at run time
    "W8A8": QuantizationScheme(_INT8_CHANNEL, input_activations=QuantizationArgs(
        num_bits=8, symmetric=True, strategy="token", group_size=None, dynamic=True)),
    # the same, with one input scale per layer calibrated on the data (no per-token work at run time)
    "W8A8_STATIC": QuantizationScheme(_INT8_CHANNEL, input_activations=QuantizationArgs(
        num_bits=8, symmetric=True, strategy="tensor", group_size=None)),
    # float8 e4m3 weights per channel, float8 inputs per token at run time: needs no data
    "FP8_DYNAMIC": QuantizationScheme(QuantizationArgs(strategy="channel", **_FP8), input_activations=QuantizationArgs(
        strategy="token", dynamic=True, **_FP8)),
    # float8 weights and inputs, one scale per tensor each (input scales calibrated)
    "FP8": QuantizationScheme(QuantizationArgs(strategy="tensor", **_FP8), input_activations=QuantizationArgs(
        strategy="tensor", **_FP8)),
    # float8 weights in 128 x 128 tiles, float8 inputs per group of 128 channels at run time
    "FP8_BLOCK": QuantizationScheme(QuantizationArgs(strategy="block", block_structure=(128, 128), **_FP8),
                                    input_activations=QuantizationArgs(**{**_FP8, "group_size": 128},
                                                                       strategy="group", dynamic=True)),
    # fp4 e2m1 weights in blocks of 16 with an fp8 scale each and one float32 scale per tensor (Blackwell)
    "NVFP4A16": QuantizationScheme(_NVFP4),
    # fp4 e2m1 weights in blocks of 32 with a power-of-two (e8m0) scale each (OCP MX)
    "MXFP4A16": QuantizationScheme(_MXFP4),
    # fp8 e4m3 weights in blocks of 32 with a power-of-two (e8m0) scale each (OCP MX)
    "MXFP8A16": QuantizationScheme(_MXFP8),
    # NVFP4 weights, fp4 inputs in blocks of 16: block scales at run time, one global input scale calibrated
    "NVFP4": QuantizationScheme(_NVFP4, input_activations=_NVFP4.replace(dynamic=True)),
    # MXFP4 weights and inputs (the inputs' power-of-two block scales at run time)
    "MXFP4": QuantizationScheme(_MXFP4, input_activations=_MXFP4.replace(dynamic=True)),
    # MXFP8 weights and inputs (the inputs' power-of-two block scales at run time)
    "MXFP8": QuantizationScheme(_MXFP8, input_activations=_MXFP8.replace(dynamic=True)),
    # int4 weights per group of 128, float8 inputs with a scale per token at run time (Hopper's W4A8 kernels)
    "W4AFP8": QuantizationScheme(QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=128),
                                 input_activations=QuantizationArgs(strategy="token", dynamic=True, **_FP8)),
}



def _integer_grid() -> dict[str, QuantizationScheme]:
    """compressed-tensors' other ``W<w>A<a>`` names for the weight widths layerwise packs (``w`` 2-4 bits; ``a``
    4, 8 or 16, ``w <= a``), so that a recipe written for llm-compressor finds them: int weights, symmetric,
    groups of 128; int inputs with a scale per token computed at run time (``A16``: none)."""
    grid = {}
    for bits in (2, 3, 4):
        for inputs in (4, 8, 16):
            name = f"W{bits}A{inputs}"
            if bits <= inputs and name not in PRESETS:
                grid[name] = QuantizationScheme(
                    QuantizationArgs(num_bits=bits, symmetric=True, strategy="group", group_size=128),
                    input_activations=None if inputs == 16 else QuantizationArgs(
                        num_bits=inputs, symmetric=True, strategy="token", group_size=None, dynamic=True))
    return grid


PRESETS.update(_integer_grid())
PRESETS["INT8"] = PRESETS["W8A8"]  # compressed-tensors' other name for it

_SCHEME_FIELDS = ("weights", "targets", "input_activations")
#: the keys of a scheme mapping in layerwise's own forms (the args, the scheme, a preset to start from)
_MAPPING_KEYS = {*_SCHEME_FIELDS, "preset", *(f.name for f in dataclasses.fields(QuantizationArgs))}


def preset_key(name: object) -> str | None:
    """The preset ``name`` spells (``W4A16``, or ``w4a16`` as compressed-tensors also reads it); else ``None``."""
    key = str(name).strip()
    return key if key in PRESETS else key.upper() if key.upper() in PRESETS else None


#: llm-compressor's default ``targets``, which the recipes it saves carry beside config groups or a
#: ``{preset: targets}`` scheme (where it is unused): read as nothing written
DEFAULT_TARGETS = (["Linear"], "Linear")


def preset_targets(value: Any, where: str) -> list[tuple[str, list[str]]] | None:
    """llm-compressor's scheme form ``{preset: targets}`` (``{W4A16: [Linear], W8A8: ["re:.*mlp.*"]}``) as
    ``(preset, targets)`` pairs in order; ``None`` for any other scheme value (a name, layerwise's mappings).

    A mapping is that form when a key names a preset, or when no key is a scheme or args field and every value
    is targets; then a key that names no preset is an error naming the closest (``W4A61``)."""
    if not isinstance(value, dict) or not value:
        return None
    targets_only = all(isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, str) for t in v))
                       for v in value.values())
    if not any(preset_key(k) for k in value) and (not targets_only or any(k in _MAPPING_KEYS for k in value)):
        return None
    pairs = []
    for key, targets in value.items():
        preset = preset_key(key)
        if preset is None:
            raise RecipeError(f"{where}: {key!r} is no preset; in llm-compressor's form {{preset: targets}} every key "
                              f"names one;{did_you_mean(key, PRESETS)} valid: {', '.join(PRESETS)}")
        targets = [targets] if isinstance(targets, str) else targets
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise RecipeError(f"{where}.{key}: give the layers this preset quantizes, e.g. {key}: [Linear]; got "
                              f"{value[key]!r}")
        pairs.append((preset, list(targets)))
    return pairs


def resolve_scheme(value: str | dict[str, Any] | QuantizationScheme) -> QuantizationScheme:
    """A :class:`QuantizationScheme` from a preset name, a mapping, or a scheme.

    Mappings take either the scheme form ``{"weights": {...}, "targets": [...]}`` or,
    as a shorthand, the weight args directly (``{"num_bits": 8, "strategy": "channel"}``);
    a ``preset`` key starts from a preset and overrides some of its weight fields.
    """
    if isinstance(value, QuantizationScheme):
        return value
    from layerwise.algorithms.quantization.config_groups import plain

    value = plain(value)  # compressed-tensors' QuantizationScheme: the mapping it saves as
    if isinstance(value, str):
        key = value.strip()
        if key in PRESETS:
            return PRESETS[key]
        upper = key.upper()
        if upper in PRESETS:
            return PRESETS[upper]
        raise UnknownNameError("scheme", value, PRESETS)
    if isinstance(value, dict):
        data = dict(value)
        if "preset" in data:
            base = resolve_scheme(data.pop("preset"))
            targets = tuple(data.pop("targets", base.targets))
            activations = _activation_args(data.pop("input_activations", base.input_activations))
            weights = data.pop("weights", {})
            fields = {**base.weights.to_dict(), **weights, **data}
            if fields.get("strategy") in ("tensor", "channel") and "group_size" not in {**weights, **data}:
                fields["group_size"] = None
            return QuantizationScheme(QuantizationArgs.from_dict(fields), targets, activations)
        if "weights" in data or "targets" in data or "input_activations" in data:
            unknown = [k for k in data if k not in _SCHEME_FIELDS]
            if unknown:
                raise RecipeError(f"unknown scheme field(s) {unknown_names(unknown, _SCHEME_FIELDS)}; "
                                  f"valid fields: {', '.join(_SCHEME_FIELDS)}")
            weights = data.get("weights")
            if weights is None:
                raise RecipeError("a scheme mapping with 'targets' also needs 'weights'")
            args = weights if isinstance(weights, QuantizationArgs) else QuantizationArgs.from_dict(weights)
            return QuantizationScheme(args, tuple(data.get("targets", ("Linear",))),
                                      _activation_args(data.get("input_activations")))
        return QuantizationScheme(QuantizationArgs.from_dict(data))
    raise RecipeError(f"a scheme must be a preset name ({', '.join(PRESETS)}), a mapping or a "
                      f"QuantizationScheme, not {type(value).__name__}")


def _activation_args(value: Any) -> QuantizationArgs | None:
    if value is None or isinstance(value, QuantizationArgs):
        return value
    data = dict(value)
    data.setdefault("num_bits", 8)  # activations: 8-bit unless said otherwise
    data.setdefault("strategy", "token" if data.get("dynamic") else "tensor")
    return QuantizationArgs.from_dict(data)
