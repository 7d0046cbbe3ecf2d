"""Smoothing mappings: which layers share an input channel scale, resolved on a model.

A mapping ``((balance patterns...), smoothed pattern)`` (``ModelPatch.smoothing_mappings``, or a
recipe's ``mappings``) says: the module matching ``smoothed`` produces the input of the balance
layers. Dividing the smoothed module's output channels by ``s`` and multiplying the balance
layers' input columns by ``s`` leaves the model's function unchanged; SmoothQuant and AWQ choose
``s``. Patterns use :mod:`layerwise.common.matching` syntax (class name, qualified name, ``re:``).
A recipe may also write a mapping as llm-compressor's AWQ does, ``{smooth_layer: ..., balance_layers:
[...]}`` (SmoothQuant's ``smooth_layers`` too); it is read as the pair.

Each smoothed module is paired with the balance layers nearest to it: those under its parent (the
block), else under the grandparent, and so on (a pattern may pick several, e.g. every expert's
``gate_proj``). A layer is paired only with the smoothed module(s) nearest to *it*, so a block
without a match (a MoE model's dense layer has no router, a cross-attention layer's ``k_proj``
does not read its norm) gets nothing rather than another block's layers. Every layer reading the
smoothed output must be a balance layer, ignored (unquantized) ones included: scaling a layer
left in full precision is exact, leaving it out is not. A mapping whose output width does not
match the balance layers' input width (``v_proj`` -> ``o_proj`` under grouped-query attention) is
skipped with its reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerwise.algorithms.quantization.storage import linear_weight
from layerwise.common.matching import find_modules, unmatched
from layerwise.errors import RecipeError, did_you_mean

Mapping = tuple[tuple[str, ...], str]
log = logging.getLogger("layerwise")


class MappingError(RecipeError):
    """A mapping that cannot be resolved on this model (a pattern matching nothing, no mappings at all)."""


@dataclass(frozen=True)
class ResolvedMapping:
    """One smoothed module and the balance layers that read its output."""

    smoothed: str
    balance: tuple[str, ...]


@dataclass(frozen=True)
class Resolution:
    """Every mapping resolved on a model, and those skipped with the reason."""

    mappings: tuple[ResolvedMapping, ...]
    skipped: tuple[tuple[str, str], ...] = ()  # (smoothed module, why)


def check_mappings(mappings: Sequence[Mapping], owner: str, patch_name: str | None) -> list[Mapping]:
    """The mappings as tuples; none at all is an error saying where they come from and how to add them."""
    if not mappings:
        where = f"the model patch {patch_name!r} declares no smoothing_mappings" if patch_name else \
            "no model patch matches this model"
        raise MappingError(f"{owner}: no smoothing mappings: {where}. Pass mappings in the recipe, e.g. "
                           f"mappings: [[[\"re:.*q_proj\", \"re:.*k_proj\", \"re:.*v_proj\"], \"re:.*input_layernorm\"]], "
                           f"or add smoothing_mappings to the patch (GUIDE.md, 'Smoothing mappings')")
    return [_as_pair(mapping, owner) for mapping in mappings]


#: how a mapping may be written, shown by every error about one
FORMS = ("[[balance patterns...], smoothed pattern] (SmoothQuant's and layerwise's pair), or "
         "{smooth_layer: smoothed pattern, balance_layers: [balance patterns...]} (llm-compressor's AWQ form)")
#: the keys of llm-compressor's mapping objects: AWQMapping's, and SmoothQuant's LayerMap's ``smooth_layers``
_SMOOTHED_KEYS = ("smooth_layer", "smooth_layers")
_MAPPING_KEYS = (*_SMOOTHED_KEYS, "balance_layers", "activation_hook_target")


def _as_pair(mapping: Any, owner: str) -> Mapping:
    """One mapping as ``((balance...), smoothed)``, from a pair or from llm-compressor's keyed form (a mapping,
    or an ``AWQMapping`` object); anything else is an error showing both forms."""
    if not isinstance(mapping, (dict, list, tuple, str)) and hasattr(mapping, "balance_layers"):
        mapping = {key: getattr(mapping, key) for key in _MAPPING_KEYS if hasattr(mapping, key)}
    if isinstance(mapping, dict):
        balance, smoothed = _keyed(mapping, owner)
    elif isinstance(mapping, (list, tuple)) and len(mapping) == 2:
        balance, smoothed = mapping
    else:
        raise MappingError(f"{owner}: a mapping is {FORMS}; got {mapping!r}")
    balance = (balance,) if isinstance(balance, str) else tuple(balance) if isinstance(balance, (list, tuple)) \
        else ()
    if not balance or not isinstance(smoothed, str) or not all(isinstance(b, str) for b in balance):
        raise MappingError(f"{owner}: a mapping is {FORMS}; got {mapping!r}")
    return balance, smoothed


def _keyed(mapping: dict[str, Any], owner: str) -> tuple[Any, Any]:
    """llm-compressor's ``{smooth_layer, balance_layers}``. Its ``activation_hook_target`` (null: the first
    balance layer, what layerwise samples) cannot be honoured otherwise: layerwise samples the first balance
    layer's input, so a mapping whose first one sees only some tokens (an expert) would search on them."""
    unknown = [key for key in mapping if key not in _MAPPING_KEYS]
    smoothed = [key for key in _SMOOTHED_KEYS if key in mapping]
    if unknown or len(smoothed) != 1 or "balance_layers" not in mapping:
        hints = [hint for key in unknown if (hint := did_you_mean(str(key), _MAPPING_KEYS))]
        raise MappingError(f"{owner}: a mapping is {FORMS}; got {mapping!r}"
                           + (f" (unknown key(s) {', '.join(map(repr, unknown))}{''.join(hints)})" if unknown else ""))
    target = mapping.get("activation_hook_target")
    if target is not None:
        raise MappingError(f"{owner}: mapping {mapping!r}: activation_hook_target {target!r} cannot be honoured: "
                           f"layerwise samples the input of the mapping's first balance layer. List first a balance "
                           f"layer every token reaches (e.g. the q_proj, not an expert) and leave "
                           f"activation_hook_target out (or null)")
    return mapping["balance_layers"], mapping[smoothed[0]]


def resolve_mappings(model: torch.nn.Module, mappings: Sequence[Mapping], *, owner: str,
                     patch_name: str | None = None) -> Resolution:
    """Pair every smoothed module with its balance layers; a pattern matching nothing is an error naming it."""
    mappings = check_mappings(mappings, owner, patch_name)
    source = f"the model patch {patch_name!r}" if patch_name else "the recipe"
    resolved: list[ResolvedMapping] = []
    skipped: list[tuple[str, str]] = []
    for balance, smoothed in mappings:
        missing = unmatched(model, [*balance, smoothed])
        if missing:
            raise MappingError(f"{owner}: mapping {list(balance)} <- {smoothed!r} of {source}: "
                               f"{', '.join(map(repr, missing))} match no module of {type(model).__name__}; "
                               f"write patterns over the qualified names `print(model)` shows")
        sources = find_modules(model, [smoothed])
        candidates = _owned(sources, [layer for pattern in balance for layer in find_modules(model, [pattern])])
        for name, module in sources.items():
            found = _nearest(name, candidates.get(name, []))
            if not found:
                skipped.append((name, "no balance layer near it"))
                continue
            why = _width_mismatch(model, name, module, found)
            if why:
                skipped.append((name, why))
                continue
            resolved.append(ResolvedMapping(name, tuple(found)))
    return Resolution(tuple(resolved), tuple(skipped))


def _scopes(name: str) -> list[str]:
    """The modules around ``name``, innermost first, the model (``""``) last: ``a.b.c`` -> ``a.b``, ``a``, ``""``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts) - 1, -1, -1)]


def _inside(name: str, scope: str) -> bool:
    return not scope or name.startswith(scope + ".")


def _owned(sources: dict[str, torch.nn.Module], layers: list[str]) -> dict[str, list[str]]:
    """Per smoothed module, the layers (in the order given, once each) for which it is among the nearest
    smoothed modules: those in the innermost scope around the layer that holds any."""
    under: dict[str, list[str]] = {}
    for source in sources:
        for scope in _scopes(source):
            under.setdefault(scope, []).append(source)
    owned: dict[str, list[str]] = {}
    for layer in dict.fromkeys(layers):
        for scope in _scopes(layer):
            owners = [s for s in under.get(scope, ()) if s != layer]
            if owners:
                for source in owners:
                    owned.setdefault(source, []).append(layer)
                break
    return owned


def _nearest(smoothed: str, candidates: list[str]) -> list[str]:
    """The candidates in the innermost scope around ``smoothed`` that holds any (its block first)."""
    for scope in _scopes(smoothed):
        inside = [n for n in candidates if _inside(n, scope)]
        if inside:
            return inside
    return []


def output_width(module: torch.nn.Module) -> int | None:
    """Channels a smoothed module produces: a norm's weight size, a Linear's out_features."""
    if isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D":
        return int(linear_weight(module).shape[0])
    weight = getattr(module, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 1 else None


def _width_mismatch(model: torch.nn.Module, name: str, module: torch.nn.Module, balance: list[str]) -> str:
    width = output_width(module)
    if width is None:
        return f"{type(module).__name__} has no per-channel weight to fold a scale into"
    for layer in balance:
        columns = int(linear_weight(model.get_submodule(layer)).shape[1])
        if columns != width:
            return f"{layer} reads {columns} channels, {name} produces {width} (e.g. grouped-query v_proj -> o_proj)"
    return ""


def without_online_inputs(model: torch.nn.Module, resolution: Resolution) -> Resolution:
    """``resolution`` less the mappings balancing a layer whose input is rotated online: scaling its input
    channels would not commute with the Hadamard applied to them first (they are skipped, with that reason)."""
    from layerwise.algorithms.quantization.online_rotation import online_hadamard

    kept, skipped = [], list(resolution.skipped)
    for mapping in resolution.mappings:
        rotated = [b for b in mapping.balance if online_hadamard(model.get_submodule(b)) is not None]
        if rotated:
            skipped.append((mapping.smoothed, f"{rotated[0]}'s input is rotated online (RotationModifier online), "
                                              f"which per-channel scales would not commute with"))
        else:
            kept.append(mapping)
    return Resolution(tuple(kept), tuple(skipped))


def mappings_for_run(model: torch.nn.Module, patch: Any, mappings: Sequence[Mapping] | None, *,
                     owner: str, discover: Callable[[torch.nn.Module], Any] | None = None
                     ) -> tuple[ResolvedMapping, ...]:
    """What a smoothing modifier works on: its recipe's ``mappings``, else the applied patch's, else (with
    ``discover``, e.g. :func:`layerwise.tracing.smoothing_layout.discover_mappings`) those found from the
    model's layout and proven exact; resolved (skipped ones logged). No mapping left at all is a
    :class:`MappingError` with the reasons."""
    given = mappings if mappings is not None else (patch.smoothing_mappings if patch is not None else ())
    patch_name = patch.name if patch is not None and mappings is None else None
    if not given and mappings is None and discover is not None:
        found = discover(model)
        if not found.mappings:
            where = f"the model patch {patch_name!r} declares no smoothing_mappings" if patch_name else \
                "no model patch matches this model"
            raise MappingError(f"{owner}: no smoothing mappings: {where}, and none was found from the layout of "
                               f"{type(model).__name__} ({found.why_none()}). Pass mappings in the recipe, e.g. "
                               f"mappings: [[[\"re:.*q_proj\", \"re:.*k_proj\", \"re:.*v_proj\"], "
                               f"\"re:.*input_layernorm\"]], or add smoothing_mappings to a patch (GUIDE.md, "
                               f"'Smoothing mappings')")
        given = found.mappings
        log.info("%s: no smoothing mappings given; found %d from the layout of %s, each proven exact on a tiny "
                 "twin", owner, len(given), type(model).__name__)
    resolution = without_online_inputs(model, resolve_mappings(model, given, owner=owner, patch_name=patch_name))
    for name, why in resolution.skipped:
        log.info("%s: %s is not smoothed: %s", owner, name, why)
    if not resolution.mappings:
        reasons = "; ".join(f"{name}: {why}" for name, why in resolution.skipped)
        raise MappingError(f"{owner}: no mapping applies to {type(model).__name__} ({reasons}); "
                           f"give mappings in the recipe")
    return resolution.mappings


def recipe_mappings(mappings: Sequence[Any] | None, owner: str) -> list[list[Any]] | None:
    """A modifier's ``mappings`` field checked when the recipe is read: ``None`` stays (the patch's are
    used), an empty list is an error, pairs and llm-compressor's ``{smooth_layer, balance_layers}`` become
    ``[[balance...], smoothed]`` (what YAML writes back)."""
    if mappings is None:
        return None
    if not mappings:
        raise MappingError(f"{owner}.mappings is empty; leave it out to use the model patch's "
                           f"smoothing_mappings, or give mappings: each {FORMS}")
    return [[list(balance), smoothed] for balance, smoothed in check_mappings(mappings, owner, None)]


def split_by_piece(pending: dict[str, ResolvedMapping], modules: Sequence[str]) -> tuple[list[ResolvedMapping],
                                                                                         list[ResolvedMapping]]:
    """The pending mappings a piece of the model (``modules``, qualified names; ``""`` the whole model)
    holds whole, and those it holds only in part: a smoothed module cached before its balance layers
    were calibrated cannot be smoothed any more."""
    def inside(name: str) -> bool:
        return any(m == "" or name == m or name.startswith(m + ".") for m in modules)

    whole, split = [], []
    for mapping in pending.values():
        found = [inside(name) for name in (mapping.smoothed, *mapping.balance)]
        if all(found):
            whole.append(mapping)
        elif any(found):
            split.append(mapping)
    return whole, split
