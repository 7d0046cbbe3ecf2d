"""Handing back the pages of a weight that viewed a checkpoint file.

transformers loads safetensors weights as views of a private (copy-on-write) map of the file.
When a modifier gives a layer new values (quantized, pruned) it swaps the parameter's storage
rather than writing into the map (writing faults every page in and copies it from the file
first). The old view is dropped, but its pages stay resident in the map as long as any other
weight of the same file lives: without handing them back, every replaced layer would count
twice in the process's memory.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from typing import Any

import torch

_FILE_PAGE = 1 << 61  # /proc/self/pagemap: the page is a (clean) file page or shared memory
_PRESENT = -(1 << 63)  # bit 63, as a signed 64-bit value


def release_mapped_pages(tensor: torch.Tensor) -> int:
    """Drop the resident pages of ``tensor``'s storage that are file pages; returns how many bytes.

    Only pages the system can read back from the file are dropped (never a page the process wrote,
    which is its own copy), so whoever else still views the storage reads the same values, at the
    cost of reading them again. Torch's own allocations, GPU memory and systems without
    ``/proc/self/pagemap`` or ``madvise`` are left alone.
    """
    if tensor.device.type != "cpu" or not hasattr(mmap, "MADV_DONTNEED") or tensor.numel() == 0:
        return 0
    storage = tensor.untyped_storage()
    if storage.resizable():  # torch allocated it: anonymous memory, freed as usual
        return 0
    page = mmap.PAGESIZE
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first, last = -(-start // page), end // page  # pages lying wholly inside the storage
    if last <= first:
        return 0
    flags = _page_flags(first, last - first)
    if flags is None:
        return 0
    droppable = ((flags & _PRESENT) != 0) & ((flags & _FILE_PAGE) != 0)
    # runs of droppable pages: where the mask turns on and off (usually one run, the whole storage)
    edges = torch.diff(droppable.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8),
                       append=torch.zeros(1, dtype=torch.int8)).nonzero().flatten().tolist()
    released = 0
    for begin, end in zip(edges[::2], edges[1::2]):
        if _madvise()((first + begin) * page, (end - begin) * page, mmap.MADV_DONTNEED) == 0:
            released += (end - begin) * page
    return released


def _page_flags(first_page: int, count: int) -> torch.Tensor | None:
    """The pagemap entries (int64) of ``count`` pages from page number ``first_page`` (None: unreadable)."""
    try:
        fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 8 * count, 8 * first_page)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) != 8 * count:
        return None
    return torch.frombuffer(bytearray(raw), dtype=torch.int64)


@functools.cache
def _madvise() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return libc.madvise
