"""Argument types the subcommands share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An argparse type: a count of 1 or more (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def memory_size(text: str) -> int:
    """An argparse type: bytes from ``80GiB``, ``80G`` (GiB), ``80GB`` (10^9), ``512MiB`` or a plain number of GiB."""
    import re

    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = found.group(2).lower() if found else ""
    if not found or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size like 80GiB, 24G or 512MiB, got {text!r}")
    scale = 2**30 if unit == "" else _UNITS[unit]
    size = int(float(found.group(1)) * scale)
    if size <= 0:  # no machine plans with none (a negative size never matches the pattern above)
        raise argparse.ArgumentTypeError(f"expected a size above zero, like 80GiB, got {text!r}")
    return size


def with_kv_cache(recipe: str, kv_cache: str | None) -> str | list:
    """The recipe of ``--recipe``, followed by the KV cache's QuantizationModifier when ``--kv-cache`` is given."""
    if kv_cache is None:
        return recipe
    return [recipe, {"QuantizationModifier": {"scheme": None, "kv_cache_scheme": kv_cache}}]
