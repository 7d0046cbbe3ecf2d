"""Errors that name the thing that is wrong and the fix."""

from __future__ import annotations

from collections.abc import Iterable


class LayerwiseError(Exception):
    """Base class of every error layerwise raises on purpose."""


class UnknownNameError(LayerwiseError, KeyError):
    """A name (modifier, scheme, pipeline, patch, ...) that nothing registered."""

    def __init__(self, kind: str, name: str, valid: Iterable[str], hint: str = "") -> None:
        self.kind, self.name, self.valid = kind, name, sorted(valid)
        listed = ", ".join(self.valid) or "(none registered)"
        message = f"unknown {kind} {name!r}; valid {kind}s: {listed}"
        super().__init__(message + (f". {hint}" if hint else ""))

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class DuplicateNameError(LayerwiseError):
    """Two plugins registered the same name for the same kind of thing."""


class PluginError(LayerwiseError):
    """A plugin failed to import or register (raised only in strict mode)."""


class RecipeError(LayerwiseError, ValueError):
    """A recipe that cannot be parsed or names unknown fields."""


class DatasetError(LayerwiseError, ValueError):
    """Calibration data that is missing, empty or of an unknown kind."""


class ModelLoadError(LayerwiseError, OSError):
    """A model path or id that cannot be loaded."""
