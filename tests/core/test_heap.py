"""Freed cache memory goes back to the system: the heap is trimmed as the cache frees."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from layerwise import heap
from layerwise.cache import IntermediatesCache

glibc_only = pytest.mark.skipif(heap._malloc_trim() is None, reason="the C library has no malloc_trim")


@glibc_only
def test_trim_returns_the_holes_freed_between_live_tensors():
    # in a fresh process whose heap serves every tensor below 1 MB: 200 MB of 512 kB tensors, every
    # other one freed; the holes sit between live tensors, so only a trim hands their pages back
    script = textwrap.dedent("""
        import torch
        from layerwise.heap import trim_heap

        def rss_mb():
            with open("/proc/self/statm") as statm:
                return int(statm.read().split()[1]) * 4096 / 2**20

        tensors = [torch.ones(128 * 1024) for _ in range(400)]
        del tensors[::2]
        before = rss_mb()
        assert trim_heap()
        print(before - rss_mb())
    """)
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) > 80, f"the trim gave back only {done.stdout.strip()} MB of ~100 MB of holes"


def test_freed_bytes_trim_once_per_threshold(monkeypatch):
    trims = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(1) or True)
    freed = heap.FreedBytes(every=100)
    for _ in range(9):
        freed.add(30)
    assert len(trims) == 2 and freed.pending == 30  # at 120 and at 240 bytes; 30 wait
    freed.flush()
    freed.flush()  # nothing new freed: no trim
    assert len(trims) == 3 == freed.trims and freed.pending == 0


def test_the_cache_trims_as_it_frees(monkeypatch):
    trims = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(1) or True)
    cache = IntermediatesCache()
    cache._freed.every = 4096 * 4  # four 1,024-float values
    for batch in range(8):
        cache.update(batch, {"hidden": torch.zeros(1024), "small": torch.zeros(4)})
    cache.free(["small"])
    assert not trims
    for batch in range(8):
        cache.free(["hidden"], batch=batch)
    assert len(trims) == 2
    cache.update(0, {"hidden": torch.zeros(1024)})
    cache.close()  # what is left is trimmed when the cache closes
    assert len(trims) == 3


def test_a_heap_with_little_free_is_not_trimmed(monkeypatch):
    trims = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(1) or True)
    monkeypatch.setattr(heap, "heap_free_bytes", lambda: 50)
    freed = heap.FreedBytes(every=100)
    freed.add(120)
    assert not trims and freed.pending == 0  # looked, found too little free: the count starts over
    monkeypatch.setattr(heap, "heap_free_bytes", lambda: 500)
    freed.add(120)
    assert len(trims) == 1


def test_the_step_grows_with_what_the_cache_holds(monkeypatch):
    trims = []
    monkeypatch.setattr(heap, "trim_heap", lambda: trims.append(1) or True)
    monkeypatch.setattr(heap, "heap_free_bytes", lambda: 10**9)
    freed = heap.FreedBytes(every=100)
    for _ in range(4):
        freed.add(60, held=1000)  # step: 1000 / 4 = 250
    assert not trims and freed.pending == 240
    freed.add(60, held=1000)
    assert len(trims) == 1
