"""Errors that name the thing that is wrong and the fix."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class LayerwiseError(Exception):
    """Base class of every error layerwise raises on purpose."""


class UnknownNameError(LayerwiseError, KeyError):
    """A name (modifier, scheme, pipeline, patch, ...) that nothing registered."""

    def __init__(self, kind: str, name: str, valid: Iterable[str], hint: str = "") -> None:
        self.kind, self.name, self.valid = kind, name, sorted(valid)
        listed = ", ".join(self.valid) or "(none registered)"
        message = f"unknown {kind} {name!r};{did_you_mean(name, self.valid)} valid {_plural(kind)}: {listed}"
        super().__init__(message + (f". {hint}" if hint else ""))

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class DuplicateNameError(LayerwiseError):
    """Two plugins registered the same name for the same kind of thing."""


class PluginError(LayerwiseError):
    """A plugin failed to import or register (raised only in strict mode)."""


class RecipeError(LayerwiseError, ValueError):
    """A recipe that cannot be parsed or names unknown fields."""


class RecipeNameError(UnknownNameError, RecipeError):
    """A recipe names a preset, modifier or key that nothing registered (catchable as either)."""


class DatasetError(LayerwiseError, ValueError):
    """Calibration data that is missing, empty or of an unknown kind."""


class ModelLoadError(LayerwiseError, OSError):
    """A model path or id that cannot be loaded."""


class InvalidArgumentError(LayerwiseError, ValueError):
    """An argument outside the values it can take (a count below 1, ...)."""


class DiskFullError(LayerwiseError, OSError):
    """A disk with no room left for what a run writes beside its output (a disk cache of activations): the
    message names the folder, how much it held and needed, and where else it can go."""


class NonFiniteError(LayerwiseError, ArithmeticError):
    """A NaN or inf where a finite number is needed: a weight, every calibration sample, a saved tensor."""


def check_choice(value: str, choices: Iterable[str], argument: str, flag: str) -> None:
    """Refuse a ``value`` of ``argument`` outside ``choices`` before anything loads, naming the closest."""
    choices = list(choices)
    if value not in choices:
        raise InvalidArgumentError(f"unknown {argument} {value!r};{did_you_mean(value, choices)} choose one of: "
                                   f"{', '.join(choices)} (CLI: {flag})")


def did_you_mean(name: object, valid: Iterable[str]) -> str:
    """`` did you mean 'X'?`` for the closest valid name(s) (case ignored), else ``""``.

    A typo is fixed faster when the error points at the name that was meant than when
    the reader has to scan the whole list; equally close names are all given.
    """
    by_lower = {v.lower(): v for v in valid}
    typed = str(name).lower()
    close = difflib.get_close_matches(typed, list(by_lower), n=5, cutoff=0.75)
    if not close:
        return ""
    best = difflib.SequenceMatcher(None, typed, close[0]).ratio()
    tied = [by_lower[c] for c in close if difflib.SequenceMatcher(None, typed, c).ratio() == best]
    return f" did you mean {' or '.join(map(repr, sorted(tied)))}?"


def unknown_names(names: Iterable[object], valid: Iterable[str]) -> str:
    """``'num_bit' (did you mean 'num_bits'?), 'foo'``: unknown field names, each with its closest valid one.

    Every place that refuses unknown fields names them the same way, so a typo deep in a config group gets
    the same help as one in a modifier's own fields.
    """
    valid = list(valid)
    return ", ".join(f"{name!r}" + (f" ({hint.strip()})" if (hint := did_you_mean(name, valid)) else "")
                     for name in names)


def require_positive(value: object, name: str, flag: str | None = None) -> int:
    """``value`` when it is an int >= 1; else an error naming the argument (and its CLI flag)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    spelled = f"{name} (CLI: {flag})" if flag else name
    raise InvalidArgumentError(f"{spelled} must be an integer >= 1, got {value!r}")


def _plural(noun: str) -> str:
    """``model patch`` -> ``model patches``, ``scheme`` -> ``schemes``."""
    return noun + ("es" if noun.endswith(("s", "ch", "sh", "x")) else "s")
