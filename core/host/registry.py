"""A named registry per kind of plugin object, remembering who registered what."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from layerwise.errors import DuplicateNameError, UnknownNameError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects of one kind (pipelines, modifiers, ...) with their owner.

    Names are unique: a second registration under a taken name raises
    :class:`DuplicateNameError` naming both owners, never silently replaces.
    """

    def __init__(self, kind: str, plural: str | None = None) -> None:
        self.kind = kind
        self.plural = plural or f"{kind}s"
        self._entries: dict[str, T] = {}
        self._owners: dict[str, str] = {}

    def add(self, name: str, obj: T, owner: str) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{self.kind} names must be non-empty strings, got {name!r} from {owner}")
        if name in self._entries:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is registered twice: by {self._owners[name]} and by {owner}; "
                f"uninstall or disable one of them (LAYERWISE_DISABLE_PLUGINS=<plugin>)"
            )
        self._entries[name] = obj
        self._owners[name] = owner

    def remove_owner(self, owner: str) -> None:
        """Forget everything one owner registered (used when its registration fails half way)."""
        for name in [n for n, o in self._owners.items() if o == owner]:
            del self._entries[name], self._owners[name]

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            error = UnknownNameError(self.kind, name, self._entries)
            if self.plural != f"{self.kind}s":  # "model patch" -> "model patches", not "model patchs"
                error.args = (error.args[0].replace(f"valid {self.kind}s:", f"valid {self.plural}:", 1),)
            raise error from None

    def owner(self, name: str) -> str:
        return self._owners[name]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def items(self) -> Iterator[tuple[str, T]]:
        return iter(sorted(self._entries.items()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)
