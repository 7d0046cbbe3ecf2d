"""One trace per kind of batch: batches that break a trace's guards get a trace of their own.

Why: a graph holds for the batches whose guards it keeps (same lengths where the forward
branched on a length, same ``None``-ness of a mask builder's result). Calibration data mixes
kinds (padded and unpadded batches, several lengths), so the sequential pipeline asks
:class:`TracesByGuards` which trace serves each batch; a batch no trace serves is traced
itself (``trace()`` learns what the opaque calls really return for its sample). Every trace
must cut the model at the same targets, so piece ``k`` of each calibrates the same modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .guards import Guard, GuardViolation
from .kinds import describe, kind_of
from .result import TraceError, TraceResult

TraceFn = Callable[[Mapping[str, Any]], TraceResult]


@dataclass
class TracesByGuards:
    """The traces a run needs, and which guard made each extra one necessary."""

    trace: TraceFn  # sample inputs -> a TraceResult that holds for them (what ``trace()`` gives)
    traces: list[TraceResult] = field(default_factory=list)
    #: one line per re-trace: the guard a batch broke and what it gave
    retraced: list[str] = field(default_factory=list)

    def for_batch(self, batch: Mapping[str, Any], label: str = "a batch") -> int:
        """Index of the trace whose guards ``batch`` keeps, tracing a new one if none does."""
        first_broken = None
        for index, result in enumerate(self.traces):
            broken = result.guard_violation(batch)
            if broken is None:
                return index
            first_broken = first_broken or broken
        result = self.trace(batch)
        broken = result.guard_violation(batch)
        if broken is not None:
            raise GuardViolation(*broken)  # even a trace of this very batch breaks it: a real limit
        self._check_same_cut(result)
        self.traces.append(result)
        if first_broken is not None:
            self.retraced.append(_reason(*first_broken, label))
        return len(self.traces) - 1

    def _check_same_cut(self, result: TraceResult) -> None:
        if not self.traces:
            return
        first = [s.target_names for s in self.traces[0].subgraphs]
        if [s.target_names for s in result.subgraphs] != first:
            raise TraceError("batches of different kinds trace into differently cut graphs "
                             f"({len(first)} vs {len(result.subgraphs)} pieces); calibrate them in separate runs "
                             "or choose targets every kind of batch runs")


def _reason(guard: Guard, got: Any, label: str) -> str:
    shown = describe(kind_of(got)) if guard.kind == "result" else repr(got)
    return f"{guard}; {label} gave {shown}: re-traced"
