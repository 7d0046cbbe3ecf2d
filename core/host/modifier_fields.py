"""What a modifier's constructor takes: its own fields, and other tools' fields read as the modifier says.

A recipe entry and a Python call (``GPTQModifier(scheme="W4A16", batched_quantization="auto")``, as
llm-compressor scripts build modifiers) are read alike, before the modifier is built: a field in the class's
``foreign_fields`` (:class:`~layerwise.host.modifier.ForeignField`) is dropped with a
:class:`ForeignFieldWarning` saying why nothing is lost, or refused naming layerwise's equivalent; any other
field the class does not have is a :class:`~layerwise.errors.RecipeError` naming the closest valid one,
never a bare ``TypeError`` from the generated ``__init__``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

from layerwise.common.user_warnings import warn_user
from layerwise.errors import RecipeError, unknown_names


class ForeignFieldWarning(UserWarning):
    """A field of another tool's recipe that layerwise reads and ignores (the message says why)."""


def public_fields(cls: type) -> list[str] | None:
    """The fields a recipe may give ``cls`` (its dataclass fields not starting with ``_``); ``None`` when it
    is no dataclass (nothing to check)."""
    if not dataclasses.is_dataclass(cls):
        return None
    return [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]


def read_foreign_fields(cls: type, fields: dict[str, Any], where: str) -> dict[str, Any]:
    """``fields`` without the other tools' fields ``cls`` ignores (each warned about, labelled ``where.<field>``)
    and with those it renames under its own name; a field it refuses is a :class:`RecipeError` carrying the
    equivalent."""
    own = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    kept = dict(fields)
    for key, foreign in getattr(cls, "foreign_fields", {}).items():
        if key not in kept or key in own:
            continue
        if any(kept[key] is value or kept[key] == value for value in foreign.layerwise_values):
            del kept[key]
            continue
        if foreign.rename is not None:
            if kept.get(foreign.rename) is not None:
                raise RecipeError(f"{where}: {key} and {foreign.rename} are one setting ({foreign.note}); give one")
            kept[foreign.rename] = kept.pop(key)
            continue
        if not foreign.ignored:
            raise RecipeError(f"{where}.{key}: an llm-compressor field layerwise does not take: {foreign.note}")
        warn_user(f"{where}.{key} is ignored: {foreign.note}", ForeignFieldWarning)
        del kept[key]
    return kept


def check_known_fields(cls: type, fields: dict[str, Any], where: str) -> None:
    """Refuse a field ``cls`` does not have, naming the closest valid field and listing them all."""
    valid = public_fields(cls)
    unknown = [k for k in fields if valid is not None and k not in valid]
    if unknown:
        raise RecipeError(f"{where}: unknown field(s) {unknown_names(unknown, valid)} for {cls.__name__}; valid "
                          f"fields: {', '.join(valid)}")


@functools.cache
def _takes_any_keyword(cls: type) -> bool:
    """Does ``cls``'s constructor take ``**kwargs`` (a plugin's own ``__init__``)? Then it reads them itself."""
    try:
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class ReadsRecipeFields(type):
    """The metaclass of :class:`~layerwise.host.modifier.Modifier`: a Python call reads its keyword
    arguments as a recipe entry's fields are read (this module's contract)."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if kwargs and not _takes_any_keyword(cls):
            kwargs = read_foreign_fields(cls, kwargs, cls.__name__)
            check_known_fields(cls, kwargs, cls.__name__)
        return super().__call__(*args, **kwargs)
