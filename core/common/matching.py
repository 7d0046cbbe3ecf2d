"""Selecting modules by class name, qualified name, or ``re:`` pattern.

One syntax everywhere (recipes, targets, ignore lists, the CLI):

* ``Linear`` / ``LlamaDecoderLayer`` -- a module class name;
* ``model.layers.0.mlp.down_proj`` -- an exact qualified module name;
* ``re:.*mlp.*`` -- a regular expression matched in full against the qualified name (llm-compressor's
  match only the start, so its ``re:.*mlp`` also selects the layers inside each MLP; here an entry
  that matches only such blocks is warned about, or for targets refused, with the pattern to write).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Iterable, Sequence

import torch

from layerwise.common.module_walk import walk_modules
from layerwise.errors import LayerwiseError


class IgnoreWarning(UserWarning):
    """A recipe's ignore entry that matches nothing: most often a typo, and the layer meant to stay dense is
    compressed."""


class PatternError(LayerwiseError, ValueError):
    """An ``re:`` entry whose regular expression does not compile."""


@functools.cache
def regex(pattern: str) -> re.Pattern[str]:
    """The compiled regular expression of an ``re:`` entry; one that does not compile is a
    :class:`PatternError` naming the entry (a usage error, not a crash deep in a run)."""
    try:
        return re.compile(pattern.removeprefix("re:"))
    except re.error as exc:
        raise PatternError(f"{pattern!r} is not a valid regular expression ({exc}); an 're:' entry is a Python "
                           f"regex matched in full against qualified module names, e.g. 're:.*mlp\\.down_proj'") \
            from None


def matches(name: str, module: torch.nn.Module, patterns: Iterable[str]) -> bool:
    """Does ``module`` (called ``name`` in its model) match any of ``patterns``?"""
    cls = type(module).__name__
    for pattern in patterns:
        if pattern.startswith("re:"):
            if regex(pattern).fullmatch(name):
                return True
        elif pattern == cls or pattern == name:
            return True
    return False


def closest_entries(entry: str, names: Sequence[str], n: int = 2) -> list[str]:
    """What an entry that matches none of ``names`` was probably meant to be: the closest names; for an ``re:``
    entry, the entry with its words corrected to the closest tail of a name (``re:.*down_prj`` ->
    ``re:.*down_proj``), so a typo is fixed in one go. Its words (runs of letters, digits and ``_``) are
    compared with the same number of dotted parts at the end of each name."""
    if not entry.startswith("re:"):
        return difflib.get_close_matches(entry, names, n=n, cutoff=0.6)
    words = re.findall(r"[A-Za-z0-9_]+", entry.removeprefix("re:"))
    if not words:
        return []
    tails = list(dict.fromkeys(".".join(name.split(".")[-len(words):]) for name in names
                               if name.count(".") + 1 >= len(words)))
    found = []
    for tail in difflib.get_close_matches(".".join(words), tails, n=n, cutoff=0.6):
        corrected = entry
        for typed, meant in zip(words, tail.split(".")):
            if typed != meant:
                corrected = re.sub(rf"(?<![A-Za-z0-9_]){re.escape(typed)}(?![A-Za-z0-9_])", meant, corrected, count=1)
        if corrected != entry and any(regex(corrected).fullmatch(name) for name in names):
            found.append(corrected)
    return found


#: ignore entries a modifier carries by default, for models that have them (an encoder has no lm_head)
DEFAULT_IGNORE = ("lm_head",)


def warn_unmatched_ignore(owner: str, missing: Sequence[str], names: Sequence[str], what: str) -> None:
    """Warn that a recipe's ignore entries ``missing`` match no ``what`` (``module of LlamaForCausalLM``), with the
    closest of ``names``: most often a typo, and the layer meant to stay dense is compressed. A warning, not an
    error: recipes written for several architectures list what some lack. The defaults are not warned about."""
    missing = [entry for entry in missing if entry not in DEFAULT_IGNORE]
    if not missing:
        return
    from layerwise.common.user_warnings import warn_user

    hints = [hint for entry in missing for hint in closest_entries(entry, names, n=1)]
    one = len(missing) == 1
    warn_user(f"{owner}.ignore: {', '.join(map(repr, missing))} match{'es' if one else ''} no {what}, so nothing is "
              f"kept out by {'it' if one else 'them'}" + (f"; did you mean {', '.join(map(repr, hints))}?" if hints
                                                          else ""), IgnoreWarning)


def warn_block_ignore(owner: str, blocks: dict[str, list[str]]) -> None:
    """Warn that ignore entries (``blocks``: entry -> the names it matches) match only modules without a weight
    whose layers inside have one, so they keep nothing out: an ``re:`` entry matches the whole qualified name
    here, where llm-compressor's ``re.match`` matches its start (its ``re:.*mlp`` keeps every MLP layer out).
    Each warning names the entry, what it matched and the pattern that keeps the layers inside out."""
    if not blocks:
        return
    from layerwise.common.user_warnings import warn_user

    for entry, names in blocks.items():
        shown = ", ".join(map(repr, names[:3])) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")
        fix = inside_pattern(entry if entry.startswith("re:") or "." in entry else names[0])
        warn_user(f"{owner}.ignore: {entry!r} matches only modules without a weight ({shown}), so it keeps no "
                  f"layer out: an 're:' entry matches the whole qualified name in layerwise (llm-compressor's "
                  f"matches its start). To keep the layers inside them out, write '{fix}'", IgnoreWarning)


def block_entries(model: torch.nn.Module, entries: Iterable[str]) -> dict[str, list[str]]:
    """The entries that match only modules without a weight (blocks) holding layers that have one, with the
    names each matches: an ignore or target written for llm-compressor's prefix matching."""
    entries = [entry for entry in entries if entry not in DEFAULT_IGNORE]
    if not entries:
        return {}
    named = walk_modules(model)
    found = {}
    for entry in entries:
        hits = [(name, module) for name, module in named if matches(name, module, [entry])]
        if hits and not any(has_weight(module) for _, module in hits) and any(
                has_weight(inner) for _, module in hits for inner in module.modules()):
            found[entry] = [name for name, _ in hits]
    return found


def is_linear_like(module: torch.nn.Module) -> bool:
    """A ``torch.nn.Linear``, or transformers' ``Conv1D`` (GPT-2), which stores a transposed Linear."""
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


_is_linear_like = is_linear_like


def find_modules(model: torch.nn.Module, targets: Iterable[str], ignore: Iterable[str] = ()) -> dict[str, torch.nn.Module]:
    """Every submodule matching ``targets`` and not ``ignore``, by qualified name.

    ``Linear`` as a target also selects transformers' ``Conv1D``.
    """
    targets, ignore = list(targets), list(ignore)
    found = {}
    for name, module in walk_modules(model):
        hit = matches(name, module, targets) or ("Linear" in targets and _is_linear_like(module))
        if hit and not matches(name, module, ignore):
            found[name] = module
    return found


def has_weight(module: torch.nn.Module) -> bool:
    """Does ``module`` hold a weight of its own (a layer), rather than only submodules that do (a block)?

    Read from ``_parameters`` first: ``nn.Module``'s attribute lookup costs more than the rest of a plan's
    per-layer work on DeepSeek-V3's 45,032 layers; a weight held otherwise (a buffer, a parametrization)
    counts too."""
    weight = module._parameters.get("weight")
    return isinstance(weight if weight is not None else getattr(module, "weight", None), torch.Tensor)


def layers_within(model: torch.nn.Module, selected: dict[str, torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """``selected`` with each module that holds no weight (a block, an attention module) replaced by the
    Linear-like layers inside it, by qualified name: llm-compressor's SparseGPT and Wanda prune "the layers
    containing targets", so their targets may name blocks (``re:model.layers.\\d*$``)."""
    containers = {name for name, module in selected.items() if not has_weight(module)}
    found = {}
    for name, module in walk_modules(model):
        itself = name in selected and name not in containers
        if itself or (is_linear_like(module) and _under_any(name, containers)):
            found[name] = module
    return found


def _under_any(name: str, containers: set[str]) -> bool:
    """Is ``name`` inside one of ``containers`` (``""``: the model)?"""
    if "" in containers:
        return True
    parts = name.split(".")
    return any(".".join(parts[:i]) in containers for i in range(1, len(parts)))


def inside_pattern(entry: str) -> str:
    """The entry rewritten to select the layers inside what ``entry`` selects (``re:.*mlp`` ->
    ``re:.*mlp\\..*``; a class name -> ``Linear``): the fix for an entry that selects only blocks."""
    if entry.startswith("re:"):
        return f"re:{entry.removeprefix('re:').removesuffix('$')}\\..*"
    if "." in entry:  # a qualified name
        return f"re:{re.escape(entry)}\\..*"
    return "Linear"


def unmatched(model: torch.nn.Module, patterns: Iterable[str]) -> list[str]:
    """Patterns that select nothing in ``model`` (a likely typo in a recipe)."""
    named = walk_modules(model)
    return [p for p in patterns
            if not any(matches(n, m, [p]) or (p == "Linear" and _is_linear_like(m)) for n, m in named)]


def paired_by_parent(model: torch.nn.Module, first: str, second: str) -> tuple[list[tuple[str, str]] | None,
                                                                              list[str], list[str]]:
    """Each module matching ``second`` with the one matching ``first`` beside it (the same parent module): the
    pairs, or ``None`` when some has no partner or a ``first`` is left over; and what each pattern matched."""
    firsts, seconds = find_modules(model, [first]), find_modules(model, [second])
    by_parent = {name.rpartition(".")[0]: name for name in firsts}
    pairs = [(by_parent.get(name.rpartition(".")[0]), name) for name in seconds]
    complete = bool(pairs) and all(a is not None for a, _ in pairs) and len(pairs) == len(firsts)
    return ([(a, b) for a, b in pairs if a is not None] if complete else None), sorted(firsts), sorted(seconds)
