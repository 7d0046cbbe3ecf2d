"""Handing the memory the intermediates cache freed back to the system.

glibc keeps freed memory in its heaps for reuse, and the cache frees in an order the
allocator reuses badly: a piece's inputs go batch by batch while its outputs, often wider
(an MLP's intermediate), are allocated above them, so the holes stay resident and unused.
On a calibration run in ``bench/`` that slack was 0.1-0.25 GB of a 1 GB peak.
``malloc_trim`` returns the free pages of every heap (a reused page costs one fault).
Where the C library has no ``malloc_trim`` (macOS, musl, Windows) nothing happens.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

#: freed cache bytes between two trims: often enough to cap the slack, rare enough to cost nothing
TRIM_EVERY_BYTES = 64 << 20


def trim_heap() -> bool:
    """Give the free pages of the C heaps back to the system; whether anything could be done."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class FreedBytes:
    """Counts bytes freed and trims the heap each time ``every`` more have gone."""

    def __init__(self, every: int = TRIM_EVERY_BYTES) -> None:
        self.every = every
        self.pending = 0
        self.trims = 0

    def add(self, nbytes: int) -> None:
        self.pending += nbytes
        if self.pending >= self.every:
            self.flush()

    def flush(self) -> None:
        """Trim now if anything was freed since the last trim."""
        if self.pending and trim_heap():
            self.trims += 1
        self.pending = 0


@functools.cache
def _malloc_trim() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return trim
