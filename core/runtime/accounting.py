"""Where a run's time goes: seconds (and, where known, floating-point operations) per phase.

Pipelines time their forwards, modifiers their own work (GPTQ: Hessians, solves); the
report shows the split, and with FLOPs counted the achieved rate, so "how close to the
machine's limit" is a number instead of a guess. A phase's seconds are its own: time
recorded by an inner phase (GPTQ's Hessian hooks inside a calibration forward) is taken
out of the enclosing :meth:`Accounting.timed` block.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class Work:
    """Seconds spent in one phase and the floating-point operations done there (0: not counted)."""

    seconds: float = 0.0
    flops: float = 0.0
    calls: int = 0

    @property
    def gflops_per_second(self) -> float | None:
        return self.flops / self.seconds / 1e9 if self.flops and self.seconds > 0 else None

    def as_dict(self) -> dict[str, float | int | None]:
        return {"seconds": round(self.seconds, 4), "flops": self.flops, "calls": self.calls,
                "gflops_per_second": None if self.gflops_per_second is None else round(self.gflops_per_second, 2)}


class Accounting(dict[str, Work]):
    """Phase name -> :class:`Work`; add to it with :meth:`add` or :meth:`timed`."""

    def __init__(self) -> None:
        super().__init__()
        self._open: list[float] = []  # per open timed() block: seconds its inner phases recorded

    def add(self, phase: str, seconds: float, flops: float = 0.0) -> None:
        self._record(phase, seconds, flops)
        if self._open:
            self._open[-1] += seconds

    @contextlib.contextmanager
    def timed(self, phase: str, flops: float = 0.0) -> Iterator[None]:
        """Time the block into ``phase`` (also when it raises), less what inner phases recorded."""
        start = time.perf_counter()
        self._open.append(0.0)
        try:
            yield
        finally:
            inner = self._open.pop()
            elapsed = time.perf_counter() - start
            self._record(phase, elapsed - inner, flops)
            if self._open:
                self._open[-1] += elapsed

    def _record(self, phase: str, seconds: float, flops: float) -> None:
        work = self.setdefault(phase, Work())
        work.seconds += seconds
        work.flops += flops
        work.calls += 1

    def as_dict(self) -> dict[str, dict[str, float | int | None]]:
        return {phase: work.as_dict() for phase, work in self.items()}


def gram_flops(rows: int, columns: int, strip: int) -> int:
    """Multiply-adds x 2 of ``X^T X``'s upper triangle computed in row strips of ``strip``."""
    return sum(2 * rows * min(strip, columns - i) * (columns - i) for i in range(0, columns, strip))


def gptq_solve_flops(rows: int, columns: int) -> int:
    """The GPTQ solve of an ``(rows, columns)`` weight: the error updates (``rows * columns^2``
    multiply-adds over the upper triangle, x 2 / 2), one Cholesky factorisation (``n^3 / 3``) and
    one triangular inverse (``n^3 / 3``)."""
    return rows * columns * columns + 2 * columns ** 3 // 3
