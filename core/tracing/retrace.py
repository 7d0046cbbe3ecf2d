"""One trace per kind of batch: batches that break a trace's guards get a trace of their own.

Why: a graph holds for the batches whose guards it keeps (same lengths where the forward
branched on a length, same ``None``-ness of a mask builder's result). Calibration data mixes
kinds (padded and unpadded batches, several lengths), so the sequential pipeline asks
:class:`TracesByGuards` which trace serves each batch; a batch no trace serves is traced
itself, with opaque results assumed as that batch really gives them. Every trace must cut
the model at the same targets, so piece ``k`` of each calibrates the same modules.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .guards import Guard, GuardViolation
from .kinds import describe, kind_of
from .meta import to_meta
from .result import TraceError, TraceResult

#: re-traces tried for one batch (each learns one more opaque result) before giving up
MAX_RETRACES = 8

TraceFn = Callable[[Mapping[str, Any], Mapping[str, Any]], TraceResult]


@dataclass
class TracesByGuards:
    """The traces a run needs, and which guard made each extra one necessary."""

    trace: TraceFn  # (sample inputs, assumed opaque results) -> TraceResult
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
        assumed: dict[str, Any] = {}
        reasons = [_reason(*first_broken, label)] if first_broken else []
        for _ in range(MAX_RETRACES):
            result = self.trace(batch, assumed)
            broken = result.guard_violation(batch)
            if broken is None:
                self._check_same_cut(result)
                self.traces.append(result)
                self.retraced.extend(reasons)
                return len(self.traces) - 1
            guard, got = broken
            if guard.kind != "result" or guard.key in assumed:
                raise GuardViolation(guard, got)  # tracing this very batch did not learn it: a real limit
            assumed[guard.key] = to_meta(got)
            reasons.append(_reason(guard, got, label))
        raise TraceError(f"{label} still breaks guards after {MAX_RETRACES} re-traces (last: {reasons[-1]})")

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
