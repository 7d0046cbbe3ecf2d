"""Turning what the user wrote (object, list, dict, YAML, preset) into modifiers.

Accepted recipe forms:

* a :class:`~layerwise.host.modifier.Modifier` instance, or a list of them;
* a preset name such as ``"W4A16"``: round-to-nearest with that scheme on every
  Linear but the output head;
* a dict ``{"GPTQModifier": {"scheme": "W4A16"}}``; modifiers may be nested under
  any stage/group keys (``{"quant_stage": {"quant_modifiers": {...}}}``), as
  recipes written for other tools often are;
* a YAML string or a path to a YAML file holding such a dict (or a list of them).

Every key, at any depth, must be a registered modifier, a stage or group that holds
one, or one of :data:`METADATA_KEYS`; anything else is a :class:`RecipeNameError`
with the closest valid name. A misspelt modifier is never dropped silently while the
rest of the recipe runs.

Recipes written for llm-compressor read as they are where layerwise can honour them: a
modifier's ``foreign_fields`` (``sequential_update``, ``offload_hessians``, ...) are dropped
with a :class:`~layerwise.host.modifier_fields.ForeignFieldWarning` saying why nothing is lost, or refused naming the layerwise
equivalent; ``config_groups`` (compressed-tensors schemes) become one modifier per group with
that scheme and targets (:mod:`layerwise.algorithms.quantization.config_groups`). A Python call
(``GPTQModifier(...)``) reads its foreign and unknown fields the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from layerwise.errors import (
    LayerwiseError,
    PluginError,
    RecipeError,
    RecipeNameError,
    did_you_mean,
)
from layerwise.host.modifier import Modifier
from layerwise.host.modifier_fields import check_known_fields, read_foreign_fields
from layerwise.host.plugin_manager import registry

RecipeLike = Modifier | list | dict | str | Path

#: keys that describe a recipe (as llm-compressor-style recipes carry them); read, never used
METADATA_KEYS = ("version", "metadata", "run_type")

def algorithm_presets() -> dict[str, str]:
    """``<ALGORITHM>_<SCHEME>`` presets (``GPTQ_W4A16``): prefix -> the registered modifier that declares it.

    A bare scheme means round-to-nearest; two modifiers declaring one prefix is an error naming both.
    """
    found: dict[str, str] = {}
    for name, cls in registry("modifiers").items():
        prefix = vars(cls).get("preset_prefix")
        if not prefix:
            continue
        if prefix in found:
            raise PluginError(f"modifiers {found[prefix]!r} and {name!r} both declare the recipe preset prefix "
                              f"{prefix!r}; one of them must choose another")
        found[prefix] = name
    return found


def chained_presets() -> dict[str, tuple[tuple[str, dict[str, Any]], ...]]:
    """Presets that chain modifiers in one calibration run, as the registered modifiers declare them."""
    found: dict[str, tuple[tuple[str, dict[str, Any]], ...]] = {}
    modifiers = registry("modifiers")
    for name in modifiers.names():
        found.update(vars(modifiers.get(name)).get("chained_presets", {}))
    return found


def preset_names() -> list[str]:
    """Every recipe preset name: the schemes (round-to-nearest), ``<ALGORITHM>_<SCHEME>`` and the chains."""
    from layerwise.algorithms.quantization.presets import PRESETS

    return [*PRESETS, *(f"{algorithm}_{scheme}" for algorithm, modifier in algorithm_presets().items()
                        for scheme in PRESETS if _takes_scheme(modifier, scheme)), *chained_presets()]


def _takes_scheme(modifier: str, scheme: str) -> bool:
    """Whether ``modifier`` builds with ``scheme`` (AutoRound learns integer weights only: no AUTOROUND_FP8 to
    offer and then refuse)."""
    try:
        _build(modifier, {"scheme": scheme}, "recipe")
    except LayerwiseError:
        return False
    return True


def parse_recipe(recipe: RecipeLike) -> list[Modifier]:
    """The list of modifier instances a recipe describes, in order."""
    if isinstance(recipe, Modifier):
        return [recipe]
    if isinstance(recipe, (list, tuple)):
        return [m for item in recipe for m in parse_recipe(item)]
    if isinstance(recipe, Path):
        return _parse_file(recipe)
    if isinstance(recipe, str):
        return _parse_string(recipe)
    if isinstance(recipe, dict):
        modifiers = _parse_mapping(recipe, path="recipe")
        if not modifiers:
            raise RecipeError("the recipe names no modifier; " + _valid_hint())
        return modifiers
    raise RecipeError(f"a recipe must be a Modifier, list, dict, YAML text, file path or preset name, "
                      f"not {type(recipe).__name__}")


def _parse_string(text: str) -> list[Modifier]:
    from layerwise.algorithms.quantization.presets import PRESETS

    stripped = text.strip()
    if stripped in PRESETS:
        return [_build("QuantizationModifier", {"scheme": stripped}, "recipe")]
    algorithm, _, scheme = stripped.partition("_")
    algorithms = algorithm_presets()
    if algorithm in algorithms and scheme in PRESETS:
        return [_build(algorithms[algorithm], {"scheme": scheme}, "recipe")]
    chains = chained_presets()
    if stripped in chains:
        return [_build(name, dict(fields), "recipe") for name, fields in chains[stripped]]
    if stripped.endswith((".yaml", ".yml")) or (("\n" not in stripped) and Path(stripped).is_file()):
        return _parse_file(Path(stripped))
    if ":" not in stripped and "\n" not in stripped:
        if stripped in registry("modifiers"):
            return [_build(stripped, {}, "recipe")]
        raise RecipeNameError(
            "recipe", stripped, [*preset_names(), *registry("modifiers").names()],
            hint="pass a preset name, a modifier name, YAML text, or the path of a YAML file",
        )
    try:
        data = yaml.safe_load(stripped)
    except yaml.YAMLError as exc:
        raise RecipeError(f"the recipe is not valid YAML: {exc}") from None
    return parse_recipe(data)


def _parse_file(path: Path) -> list[Modifier]:
    if not path.is_file():
        raise RecipeError(f"recipe file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RecipeError(f"recipe file {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        raise RecipeError(f"recipe file {str(path)!r} is empty")
    return parse_recipe(data)


def _parse_mapping(mapping: dict, path: str) -> list[Modifier]:
    modifiers = []
    known = registry("modifiers").names()
    for key, value in mapping.items():
        where = f"{path}.{key}"
        if key in known:
            modifiers.extend(_build_all(key, value or {}, where))
        elif key in METADATA_KEYS:
            continue
        elif not str(key).lower().endswith("modifier") and _is_group(value, known):
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                modifiers.extend(_parse_mapping(item, where if isinstance(value, dict) else f"{where}[{i}]"))
        elif value is None or isinstance(value, dict):  # a modifier's place, under a name nobody registered
            raise RecipeNameError("modifier", str(key), known, hint=f"(at {where})")
        elif isinstance(value, list) and value and any(isinstance(item, dict) for item in value):
            bad = next(i for i, item in enumerate(value) if not isinstance(item, dict))
            raise RecipeError(f"{where}[{bad}]: {value[bad]!r} is not a mapping; each item of a list of "
                              f"modifiers is one, e.g. {{{known[0]}: {{...}}}}")
        else:
            raise RecipeNameError("recipe key", str(key), METADATA_KEYS, hint=(
                f"(at {where}); any other key must be a modifier ({', '.join(known)}) or a stage or "
                f"group holding modifiers"))
    return modifiers


def _is_group(value: Any, known: list[str]) -> bool:
    """A stage or group: a list of mappings, or a mapping that is not one modifier's fields.

    A mapping of plain values under keys that name no modifier (``{scheme: W4A16}``) is
    a modifier's fields, so the key above it must have been a modifier's name.
    """
    if isinstance(value, list):
        return all(isinstance(item, dict) for item in value)
    if not isinstance(value, dict):
        return False
    nested = any(isinstance(v, dict) or (isinstance(v, list) and any(isinstance(i, dict) for i in v))
                 for v in value.values())
    named = any(k in known or k in METADATA_KEYS or str(k).lower().endswith("modifier") or did_you_mean(k, known)
                for k in value)
    return not value or nested or named


def _build_all(name: str, fields: Any, where: str) -> list[Modifier]:
    """The modifier(s) a recipe entry describes: its foreign fields dropped or refused, its
    ``config_groups`` or llm-compressor's ``scheme: {preset: targets}`` (if any) one instance per group."""
    from layerwise.algorithms.quantization.presets import preset_targets

    cls = registry("modifiers").get(name)
    if not isinstance(fields, dict):
        raise RecipeError(f"{where}: the fields of {name} must be a mapping, got {fields!r}")
    own = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    fields = read_foreign_fields(cls, fields, where)
    # a modifier's own config_groups field takes one group; the recipe expands every quantizer's groups
    groups_field = "config_groups" in own and getattr(cls, "max_config_groups", 0) == 0
    if "config_groups" in fields and not groups_field:
        return _expand_config_groups(cls, name, fields, where)
    presets = preset_targets(fields.get("scheme"), f"{where}.scheme") if "scheme" in own else None
    if presets is not None and getattr(cls, "max_config_groups", 0) != 0:
        return _expand_preset_targets(cls, name, fields, where, presets)
    return [_build(name, fields, where)]


def _expand_config_groups(cls: type, name: str, fields: dict[str, Any], where: str) -> list[Modifier]:
    from layerwise.algorithms.quantization.config_groups import read_config_groups

    if getattr(cls, "max_config_groups", 0) == 0:
        raise RecipeError(f"{where}.config_groups: {name} quantizes nothing, so it takes no config_groups")
    _refuse_beside_groups(fields, where, "config_groups", "each config group", "in each group "
                          "(config_groups.<name>.targets)")
    groups = read_config_groups(fields.pop("config_groups"), f"{where}.config_groups")
    return _build_groups(cls, name, fields, where, groups, "config_groups")


def _expand_preset_targets(cls: type, name: str, fields: dict[str, Any], where: str,
                           presets: list[tuple[str, list[str]]]) -> list[Modifier]:
    """llm-compressor's ``scheme: {W4A16: [Linear], W8A8: ["re:.*mlp.*"]}``: each preset on its targets, read as
    config groups are (one modifier each; a layer two presets target goes to the more specific target)."""
    from layerwise.algorithms.quantization.config_groups import ConfigGroup
    from layerwise.algorithms.quantization.presets import PRESETS

    fields.pop("scheme")
    _refuse_beside_groups(fields, where, "scheme {preset: targets}", "each preset", "in the mapping "
                          "({preset: [targets]})")
    groups = [ConfigGroup(preset, tuple(targets), dataclasses.replace(PRESETS[preset], targets=tuple(targets)))
              for preset, targets in presets]
    return _build_groups(cls, name, fields, where, groups, "scheme")


def _refuse_beside_groups(fields: dict[str, Any], where: str, form: str, carrier: str, targets_at: str) -> None:
    """The fields that would contradict groups carrying their own scheme and targets are refused; llm-compressor's
    default ``targets: [Linear]`` (unused beside groups there too) is dropped."""
    given = [k for k in ("scheme", "num_bits", "symmetric", "strategy", "group_size") if k in fields]
    if given:
        raise RecipeError(f"{where}: give {form} or {', '.join(given)}, not both: {carrier} carries its own scheme "
                          f"and targets")
    from layerwise.algorithms.quantization.presets import DEFAULT_TARGETS

    if fields.get("targets") in DEFAULT_TARGETS:
        del fields["targets"]
    if "targets" in fields:
        raise RecipeError(f"{where}: with {form} the targets go {targets_at}; the modifier's own targets field "
                          f"would be a second list (llm-compressor ignores it)")


def _build_groups(cls: type, name: str, fields: dict[str, Any], where: str, groups: list[Any],
                  field: str) -> list[Modifier]:
    """One ``cls`` per group (its scheme and targets, the other groups' targets ignored where they are more
    specific); errors are labelled ``where.<field>.<group>``, or ``where`` when the modifier's own fields fail."""
    from layerwise.algorithms.quantization.config_groups import exclusive_ignores

    limit = getattr(cls, "max_config_groups", 0)
    if limit is not None and len(groups) > limit:
        raise RecipeError(f"{where}.{field}: {name} takes {limit} config group (it searches each smoothing "
                          f"mapping for one scheme), got {len(groups)}: keep one here and quantize the other "
                          f"layers with a QuantizationModifier or GPTQModifier after it")
    ignore = fields.pop("ignore", None)
    ignore = [ignore] if isinstance(ignore, str) else list(ignore) if ignore is not None else None
    _split_observer_mapping(fields, where)
    # one KV cache per model: it goes with the FP8 attention group if there is one, else with the first group
    kv_cache = fields.pop("kv_cache_scheme", None)
    kv_owner = next((i for i, group in enumerate(groups) if group.attention is not None), 0)
    built = []
    for i, (group, exclusive) in enumerate(zip(groups, exclusive_ignores(groups))):
        base = ignore if ignore is not None else list(_default(cls, "ignore") or [])
        group_fields = {**fields, "scheme": group.scheme, "targets": list(group.targets),
                        "ignore": [*base, *exclusive]}
        if group.attention is not None:
            group_fields["attention_scheme"] = group.attention.to_dict()
        if i == kv_owner and kv_cache is not None:
            group_fields["kv_cache_scheme"] = kv_cache
        if "input_observer" in group_fields and not _calibrates_inputs(group) and any(map(_calibrates_inputs, groups)):
            del group_fields["input_observer"]  # it is for the groups with static inputs (no warning for the others)
        built.append(_build(name, group_fields, f"{where}.{field}.{group.name}",
                            own=(where, lambda exc: _own_fault(cls, fields, exc))))
    return built


def _split_observer_mapping(fields: dict[str, Any], where: str) -> None:
    """llm-compressor's ``observer: {weights, input, output}`` split before the groups share it, so that the
    input part can go only to the groups whose inputs take a calibrated scale (each warns otherwise)."""
    from layerwise.algorithms.quantization.config_groups import split_observers

    if not isinstance(fields.get("observer"), dict):
        return
    weights, inputs, output = split_observers(fields.pop("observer"), fields.pop("input_observer", None), where)
    fields.update({k: v for k, v in (("observer", weights), ("input_observer", inputs)) if v is not None})
    if output is not None:
        fields["observer"] = {"weights": weights, "output": output}  # the modifier warns about it once per group


def _calibrates_inputs(group: Any) -> bool:
    """Does a config group's scheme take calibrated (static) input scales, which an input observer measures?"""
    inputs = group.scheme.input_activations if group.scheme is not None else None
    return inputs is not None and inputs.calibrated


def _own_fault(cls: type, fields: dict[str, Any], exc: Exception) -> bool:
    """Does building ``cls`` from the modifier's own fields alone (no config group) fail the same way? Then
    the error is the modifier's (``GPTQModifier.actorder``), not the group's, and is labelled so."""
    try:
        cls(**fields)
    except (TypeError, ValueError, KeyError) as alone:
        return str(alone) == str(exc)
    return False


def _default(cls: type, name: str) -> Any:
    """A dataclass field's default value (``None`` when it has none)."""
    for item in dataclasses.fields(cls):
        if item.name == name:
            if item.default_factory is not dataclasses.MISSING:
                return item.default_factory()
            return None if item.default is dataclasses.MISSING else item.default
    return None


def _build(name: str, fields: Any, where: str,
           own: tuple[str, Callable[[Exception], bool]] | None = None) -> Modifier:
    """``name`` built from ``fields``; an error is labelled ``where``. A config group's modifier also gets
    ``own``: the modifier's place, and whether an error is the modifier's own fields' (then labelled there,
    as an unknown field always is: a group adds only known ones)."""
    cls = registry("modifiers").get(name)
    if not isinstance(fields, dict):
        raise RecipeError(f"{where}: the fields of {name} must be a mapping, got {fields!r}")
    check_known_fields(cls, fields, where if own is None else own[0])
    try:
        return cls(**fields)
    except (TypeError, ValueError, KeyError) as exc:
        if own is not None and own[1](exc):
            where = own[0]
        raise RecipeError(f"{where}: cannot build {name}: {exc}") from exc


def _valid_hint() -> str:
    return "valid modifiers: " + ", ".join(registry("modifiers").names())


def recipe_to_yaml(modifiers: list[Modifier]) -> str:
    """The YAML text that rebuilds ``modifiers`` (saved next to the compressed model)."""
    return yaml.safe_dump({"layerwise_stage": {"modifiers": [m.to_dict() for m in modifiers]}},
                          sort_keys=False)
