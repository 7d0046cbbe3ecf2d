"""Handing the memory the intermediates cache freed back to the system, and only that.

glibc keeps freed memory in its heaps for reuse, and the cache frees in an order the
allocator reuses badly: a piece's inputs go batch by batch while its outputs, often wider
(an MLP's intermediate), are allocated above them, so the holes stay resident and unused.
On a calibration run in ``bench/`` that slack was 0.1-0.25 GB of a 1 GB peak.
``malloc_trim`` returns the free pages of every heap (a reused page costs one fault).
Where the C library has no ``malloc_trim`` (macOS, musl, Windows) nothing happens.

The other way round, glibc by default gives back too much: a block's temporaries (a few MB
each) are mapped fresh or trimmed off the heap's top as soon as they are freed, so every
forward faults them in again, zeroed, page by page (1,300 faults a call on a tiny-llama-doc
decoder layer, a sixth of its time). :func:`keep_temporaries_in_heap` raises the two
thresholds once per process when a run is cut at blocks, leaving the returning to the cache's trims.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any

#: freed bytes between two looks at the heap: at least this, or HELD_FRACTION of what the cache holds
TRIM_EVERY_BYTES = 32 << 20
#: the step as a fraction of what the cache holds: 1/4 let a piece free its whole input (tiny-llama-doc's
#: 96 MB hidden state, against 384 MB held) untrimmed while its wider outputs grew above it, so a GPTQ run's
#: peak RSS varied 0.94-1.13 GB; at 1/16 (and 32 MB) it was 0.89-0.93 GB, for ~0.5 s more page faults of 40 s
HELD_FRACTION = 16


def trim_heap() -> bool:
    """Give the free pages of the C heaps back to the system; whether anything could be done."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


#: glibc's mmap threshold while layerwise runs: blocks up to this size come from the heap (its ceiling on 64-bit)
MMAP_THRESHOLD_BYTES = 32 << 20
#: free bytes the heap's top may hold before glibc trims it itself: above a decoder layer's temporaries
TRIM_THRESHOLD_BYTES = 16 << 20
#: glibc's ``mallopt`` parameter numbers (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: the environment variables by which a user tunes glibc's malloc: when one is set, theirs is kept
_USER_MALLOC_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


@functools.cache
def keep_temporaries_in_heap() -> bool:
    """Let freed blocks up to 32 MB stay in glibc's heap for the next forward; whether the thresholds were set.

    Measured on tiny-llama-doc (2 cores): a Wanda run (blocks) 14.4-15.8 s -> 12.2 s, 1.9 M -> 50 k page
    faults, peak RSS 0.70 -> 0.62 GB (the cache's trims return what it frees); GPTQ (layers) no faster,
    its peak 1.00 -> 1.03-1.10 GB, so only the blocks cut calls this. Process-wide and kept: setting a
    threshold ends glibc's own adjusting of them, which no call can bring back, and glibc's fixed
    defaults (128 kB) would map every larger tensor afresh.
    Left alone when the user tuned malloc (``MALLOC_*_`` or ``GLIBC_TUNABLES``) or the C library has
    no ``mallopt``.
    """
    if any(name in os.environ for name in _USER_MALLOC_SETTINGS) or "glibc.malloc" in os.environ.get(
            "GLIBC_TUNABLES", ""):
        return False
    mallopt = _libc_function("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)
    if mallopt is None:
        return False
    # the mmap threshold first: setting either ends the dynamic adjusting, and a trim threshold set
    # alone would leave every block above glibc's initial 128 kB mapped afresh
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def heap_free_bytes() -> int | None:
    """Bytes the C heaps hold free (resident or not); None where glibc's ``mallinfo2`` is missing."""
    info = _mallinfo2()
    return None if info is None else int(info().fordblks)


class FreedBytes:
    """Counts the bytes the cache frees; each time a step's worth has gone, trims the heap if it holds as much free.

    The step is ``every`` or :data:`HELD_FRACTION` of what the cache still holds, whichever is larger, so a
    large cache is not trimmed every other batch. A trim also returns the pages the next batch's
    temporaries would have reused (they fault back in: 0.3 s on a 3 s MiniLM run trimmed six
    times), so a heap holding less than a step free is left alone.
    """

    def __init__(self, every: int = TRIM_EVERY_BYTES) -> None:
        self.every = every
        self.pending = 0
        self.trims = 0

    def add(self, nbytes: int, held: int = 0) -> None:
        """``nbytes`` were freed; the cache still holds ``held`` bytes."""
        self.pending += nbytes
        step = max(self.every, held // HELD_FRACTION)
        if self.pending >= step:
            free = heap_free_bytes()
            if free is None or free >= step:
                self.flush()
            else:
                self.pending = 0

    def flush(self) -> None:
        """Trim now if anything was freed since the last trim."""
        if self.pending and trim_heap():
            self.trims += 1
        self.pending = 0


@functools.cache
def _libc_function(name: str, argtypes: tuple[Any, ...], restype: Any) -> Any:
    """The C library's function ``name`` with its signature set, or None where the library lacks it."""
    library = ctypes.util.find_library("c")
    try:
        function = getattr(ctypes.CDLL(library) if library else ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    function.argtypes, function.restype = argtypes, restype
    return function


def _malloc_trim() -> Any:
    return _libc_function("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2() -> Any:
    return _libc_function("mallinfo2", (), _MallInfo2)
