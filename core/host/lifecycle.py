"""Fires lifecycle events on every modifier, and guarantees their hooks are removed.

Events: initialize -> calibration_start -> sequential_epoch_end(modules) ... ->
calibration_end -> finalize. Pipelines call these; modifiers only react.

With several ranks (:mod:`layerwise.runtime.distributed`) every ``sequential_epoch_end(modules)`` and the
``calibration_end`` are preceded by ``reduce``: the ranks meet (one that failed is reported on all),
then every modifier's ``on_reduce(state, reducer, modules)`` merges its statistics over the ranks.
``finalize`` ends with a last meeting, before anything is saved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from layerwise.host.modifier import Modifier
from layerwise.host.state import CompressionState
from layerwise.runtime import distributed


class Lifecycle:
    """Drives ``state.modifiers`` through the events in order."""

    def __init__(self, state: CompressionState) -> None:
        self.state = state
        self.modifiers: list[Modifier] = list(state.modifiers)
        #: merges statistics over the ranks; ``None`` with one process (``on_reduce`` is never fired)
        self.reducer = (distributed.Reducer(len(getattr(state, "batches", None) or []))
                        if distributed.world_size() > 1 else None)
        self._counted = False

    def initialize(self) -> None:
        for m in self.modifiers:
            m.on_initialize(self.state)

    def calibration_start(self) -> None:
        for m in self.modifiers:
            m.on_calibration_start(self.state)

    def reduce(self, modules: list[str] | None) -> None:
        """With several ranks: meet them (a failed one is an error here), then merge every modifier's statistics."""
        reducer = self.reducer
        if reducer is None:
            return
        distributed.check()
        if not self._counted:
            reducer.total_samples = int(reducer.count(reducer.samples))
            self._counted = True
        for m in self.modifiers:
            m.on_reduce(self.state, reducer, modules)

    def sequential_epoch_end(self, modules: list[str]) -> None:
        self.reduce(modules)
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
            self.reduce(None)
            for m in self.modifiers:
                m.on_calibration_end(self.state)
        finally:
            self.remove_hooks()

    def finalize(self) -> None:
        for m in self.modifiers:
            m.on_finalize(self.state)
        if self.reducer is not None:
            distributed.check()  # no rank saves while another one failed

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
