"""Named quantization schemes (``W4A16`` ...) and turning recipe values into schemes."""

from __future__ import annotations

from typing import Any

from ..errors import RecipeError, UnknownNameError
from .args import QuantizationArgs, QuantizationScheme

#: weight-only presets; activations stay in 16/32-bit floating point
PRESETS: dict[str, QuantizationScheme] = {
    # int4, symmetric, one scale per 128 input columns of each output row
    "W4A16": QuantizationScheme(QuantizationArgs(num_bits=4, symmetric=True, strategy="group", group_size=128)),
    # int4, asymmetric (scale and zero point) per group of 128
    "W4A16_ASYM": QuantizationScheme(QuantizationArgs(num_bits=4, symmetric=False, strategy="group",
                                                      group_size=128)),
    # int8, symmetric, one scale per output channel
    "W8A16": QuantizationScheme(QuantizationArgs(num_bits=8, symmetric=True, strategy="channel",
                                                 group_size=None)),
}

_SCHEME_FIELDS = ("weights", "targets")


def resolve_scheme(value: str | dict[str, Any] | QuantizationScheme) -> QuantizationScheme:
    """A :class:`QuantizationScheme` from a preset name, a mapping, or a scheme.

    Mappings take either the scheme form ``{"weights": {...}, "targets": [...]}`` or,
    as a shorthand, the weight args directly (``{"num_bits": 8, "strategy": "channel"}``);
    a ``preset`` key starts from a preset and overrides some of its weight fields.
    """
    if isinstance(value, QuantizationScheme):
        return value
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
            weights = data.pop("weights", {})
            fields = {**base.weights.to_dict(), **weights, **data}
            if fields.get("strategy") in ("tensor", "channel") and "group_size" not in {**weights, **data}:
                fields["group_size"] = None
            return QuantizationScheme(QuantizationArgs.from_dict(fields), targets)
        if "weights" in data or "targets" in data:
            unknown = [k for k in data if k not in _SCHEME_FIELDS]
            if unknown:
                raise RecipeError(f"unknown scheme field(s) {', '.join(map(repr, unknown))}; "
                                  f"valid fields: {', '.join(_SCHEME_FIELDS)}")
            weights = data.get("weights")
            if weights is None:
                raise RecipeError("a scheme mapping with 'targets' also needs 'weights'")
            args = weights if isinstance(weights, QuantizationArgs) else QuantizationArgs.from_dict(weights)
            return QuantizationScheme(args, tuple(data.get("targets", ("Linear",))))
        return QuantizationScheme(QuantizationArgs.from_dict(data))
    raise RecipeError(f"a scheme must be a preset name ({', '.join(PRESETS)}), a mapping or a "
                      f"QuantizationScheme, not {type(value).__name__}")
