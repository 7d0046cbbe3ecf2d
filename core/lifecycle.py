"""Fires lifecycle events on every modifier, and guarantees their hooks are removed.

Events: initialize -> calibration_start -> sequential_epoch_end(modules) ... ->
calibration_end -> finalize. Pipelines call these; modifiers only react.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .modifier import Modifier
from .state import CompressionState


class Lifecycle:
    """Drives ``state.modifiers`` through the events in order."""

    def __init__(self, state: CompressionState) -> None:
        self.state = state
        self.modifiers: list[Modifier] = list(state.modifiers)

    def initialize(self) -> None:
        for m in self.modifiers:
            m.on_initialize(self.state)

    def calibration_start(self) -> None:
        for m in self.modifiers:
            m.on_calibration_start(self.state)

    def sequential_epoch_end(self, modules: list[str]) -> None:
        for m in self.modifiers:
            m.on_sequential_epoch_end(self.state, modules)

    def calibration_inputs(self, modules: list[str]) -> set[str] | None:
        """The modules (of ``modules``) whose inputs some modifier reads; ``None``: the whole forward matters."""
        needed: set[str] = set()
        for m in self.modifiers:
            names = m.calibration_inputs(modules)
            if names is None:
                return None
            needed.update(names)
        return needed

    def calibration_end(self) -> None:
        try:
            for m in self.modifiers:
                m.on_calibration_end(self.state)
        finally:
            self.remove_hooks()

    def finalize(self) -> None:
        for m in self.modifiers:
            m.on_finalize(self.state)

    def remove_hooks(self) -> None:
        for m in self.modifiers:
            m.remove_hooks()

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[Lifecycle]:
        """``calibration_start`` on enter, ``calibration_end`` on success, hooks gone on every exit."""
        self.calibration_start()
        try:
            yield self
        except BaseException:
            self.remove_hooks()
            raise
        self.calibration_end()
