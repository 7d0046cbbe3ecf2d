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
