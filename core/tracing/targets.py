"""Choosing and resolving sequential targets and ignore entries to qualified module names.

Entries are module class names (``LlamaDecoderLayer``), exact qualified names, or
``re:<regex>`` matched in full against qualified names (the syntax of
:mod:`layerwise.common.matching`).

Where targets come from, first that gives any wins (:func:`choose_targets`):

1. ``given`` -- what the user passed; an entry that matches nothing is an error, never
   a reason to try something else;
2. ``patch`` -- the model patch's ``sequential_targets`` (a warning when they match
   nothing in this model, then the next source);
3. ``_no_split_modules`` -- declared by the transformers model class;
4. ``structure`` -- the repeated blocks :func:`~layerwise.tracing.discovery.discover_blocks` finds.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from layerwise.common.matching import closest_entries, matches, unmatched
from layerwise.common.module_walk import walk_modules
from layerwise.common.user_warnings import warn_user

from ..errors import LayerwiseError
from .discovery import discover_blocks

if TYPE_CHECKING:
    from layerwise.host.model_patch import ModelPatch


class TargetError(LayerwiseError, ValueError):
    """Sequential targets or ignore entries that are missing, match nothing, or cannot be resolved.

    ``unmatched`` holds the entries that select nothing, ``suggestions`` the close names for each.
    """

    def __init__(self, message: str, *, unmatched: Sequence[str] = (),
                 suggestions: Mapping[str, Sequence[str]] | None = None) -> None:
        super().__init__(message)
        self.unmatched = tuple(unmatched)
        self.suggestions = {k: tuple(v) for k, v in (suggestions or {}).items()}


class TargetWarning(UserWarning):
    """A model patch's sequential targets select nothing in this model; the next source is used."""


#: where sequential targets came from, in the order they are tried
TARGET_SOURCES: tuple[str, ...] = ("given", "patch", "_no_split_modules", "structure")
_LABELS = {"given": "given", "patch": "from the model patch", "_no_split_modules": "from _no_split_modules",
           "structure": "found by structure", "none": "none found"}


@dataclass(frozen=True)
class TargetChoice:
    """The sequential targets chosen for a model and where they came from."""

    #: entries as the pipelines take them (class names, qualified names, ``re:`` patterns)
    targets: tuple[str, ...]
    #: one of :data:`TARGET_SOURCES`, or ``"none"`` when nothing was found
    source: str

    @property
    def label(self) -> str:
        """``found by structure``, ``from _no_split_modules``, ..."""
        return _LABELS[self.source]

    def describe(self, model: torch.nn.Module) -> str:
        """``6 x BertLayer (encoder.layer.0-5), found by structure`` (what the entries select)."""
        if not self.targets:
            return "none found (the whole model is calibrated at once)"
        return f"{describe_modules(resolve_modules(model, self.targets))}, {self.label}"


def choose_targets(model: torch.nn.Module, given: Sequence[str] | None = None,
                   patch: ModelPatch | None = None) -> TargetChoice:
    """The sequential targets for ``model``: given > patch > ``_no_split_modules`` > structure.

    Given entries that match nothing raise :class:`TargetError` with the closest names;
    nothing found anywhere gives an empty choice (source ``"none"``).
    """
    if given:
        check_entries(model, given, "sequential target")
        return TargetChoice(tuple(given), "given")
    if patch is not None and patch.sequential_targets:
        if resolve_modules(model, patch.sequential_targets):
            return TargetChoice(tuple(patch.sequential_targets), "patch")
        warn_user(f"model patch {patch.name!r} names sequential targets {list(patch.sequential_targets)} that "
                  f"match no module of {type(model).__name__}; using the model's own blocks instead. "
                  "Fix the patch's sequential_targets", TargetWarning)
    declared = _no_split_modules(model)
    if declared and resolve_modules(model, declared):
        return TargetChoice(tuple(declared), "_no_split_modules")
    found = discover_blocks(model)
    if found:
        return TargetChoice(found.targets, "structure")
    return TargetChoice((), "none")


def default_targets(model: torch.nn.Module) -> list[str]:
    """Targets when none are given and no patch applies: ``_no_split_modules``, else the discovered blocks."""
    choice = choose_targets(model)
    if not choice.targets:
        raise TargetError(
            f"{type(model).__name__} declares no _no_split_modules and has no list of repeated blocks "
            "(a ModuleList of >= 2 same-class modules holding Linear layers), so there are no default "
            "sequential targets; pass sequential_targets=[...] (class names or 're:<regex>' on module names)")
    return list(choice.targets)


def _no_split_modules(model: torch.nn.Module) -> list[str]:
    names = getattr(model, "_no_split_modules", None) or []
    if isinstance(names, str):
        names = [names]
    return list(dict.fromkeys(names))


def check_entries(model: torch.nn.Module, entries: Iterable[str], kind: str) -> None:
    """Raise :class:`TargetError` naming every entry of ``entries`` that selects no module of ``model``.

    ``kind`` names the entries in the message (``sequential target``, ``ignore entry``).
    The error suggests the closest class and module names, so a typo is fixed in one go.
    """
    missing = unmatched(model, entries)
    if not missing:
        return
    named = walk_modules(model)
    classes = sorted({type(m).__name__ for _, m in named})
    names = [n for n, _ in named if n]
    suggestions = {entry: _closest(entry, classes, names) for entry in missing}
    lines = []
    for entry in missing:
        close = suggestions[entry]
        hint = f"did you mean {' or '.join(repr(c) for c in close)}?" if close else \
            f"classes here include {', '.join(classes[:8])}"
        lines.append(f"{kind} {entry!r} matches no module of {type(model).__name__}; {hint}")
    raise TargetError("; ".join(lines) + " (entries are class names, qualified module names or 're:<regex>' "
                      "matched in full against qualified names)", unmatched=missing, suggestions=suggestions)


def _closest(entry: str, classes: Sequence[str], names: Sequence[str]) -> list[str]:
    if entry.startswith("re:"):  # the pattern's words corrected to the closest names' tails
        return closest_entries(entry, names)
    return difflib.get_close_matches(entry, [*classes, *names], n=3, cutoff=0.6)


def describe_modules(found: Mapping[str, torch.nn.Module]) -> str:
    """``6 x BertLayer (encoder.layer.0-5)``: resolved targets grouped by list and class."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, module in found.items():
        prefix, _, last = name.rpartition(".")
        key = (prefix, type(module).__name__) if last.isdigit() else (name, type(module).__name__)
        groups.setdefault(key, []).append(last if last.isdigit() else "")
    parts = []
    for (prefix, cls), items in groups.items():
        lead = f"{prefix}." if prefix else ""
        numbers = [int(i) for i in items if i]
        if len(numbers) == len(items) and len(numbers) > 1 and numbers == list(range(numbers[0], numbers[-1] + 1)):
            span = f"{lead}{numbers[0]}-{numbers[-1]}"
        else:
            span = ", ".join(f"{lead}{i}" if i else prefix for i in items)
        parts.append(f"{len(items)} x {cls} ({span})")
    return ", ".join(parts)


def resolve_modules(model: torch.nn.Module, patterns: Sequence[str], *, outermost: bool = True) -> dict[str, torch.nn.Module]:
    """Qualified name -> module for every module matching ``patterns``, in definition order.

    With ``outermost`` a match nested inside another match is dropped (a block's own
    sub-blocks are calibrated with it).
    """
    found: dict[str, torch.nn.Module] = {}
    inside = None  # the prefix of the last match kept: the walk lists a subtree right after its root
    for name, module in walk_modules(model):
        if not name or (outermost and inside is not None and name.startswith(inside)):
            continue
        if matches(name, module, patterns):
            found[name] = module
            inside = name + "."
    return found


def resolve_targets(model: torch.nn.Module, targets: Sequence[str] | None) -> dict[str, torch.nn.Module]:
    """Sequential target modules by qualified name; an error when the entries match nothing."""
    patterns = list(targets) if targets is not None else default_targets(model)
    found = resolve_modules(model, patterns)
    if not found:
        classes = sorted({type(m).__name__ for _, m in model.named_modules()})
        raise TargetError(
            f"sequential targets {patterns} match no module of {type(model).__name__}; "
            f"use class names (some here: {', '.join(classes[:12])}) or 're:<regex on module names>'")
    return found
