"""Freed cache memory goes back to the system: the heap is trimmed as the cache frees."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from layerwise.runtime import heap
from layerwise.runtime.cache import IntermediatesCache

glibc_only = pytest.mark.skipif(heap._malloc_trim() is None, reason="the C library has no malloc_trim")


@glibc_only
def test_trim_returns_the_holes_freed_between_live_tensors():
    # in a fresh process whose heap serves every tensor below 1 MB: 200 MB of 512 kB tensors, every
    # other one freed; the holes sit between live tensors, so only a trim hands their pages back
    script = textwrap.dedent("""
        import torch
        from layerwise.runtime.heap import trim_heap

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
    for batch in range(8):  # values differing per batch (equal ones would be held once)
        cache.update(batch, {"hidden": torch.full((1024,), float(batch)), "small": torch.full((4,), float(batch))})
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
    held = 250 * heap.HELD_FRACTION  # step: 250
    for _ in range(4):
        freed.add(60, held=held)
    assert not trims and freed.pending == 240
    freed.add(60, held=held)
    assert len(trims) == 1


_TEMPORARIES_SCRIPT = textwrap.dedent("""
    import ctypes, resource
    import torch
    from layerwise.runtime import heap

    def forward():  # a layer's temporaries: six 2 MB blocks, freed together at its end
        temps = [torch.ones(512 * 1024) for _ in range(6)]
        del temps

    def faults():
        forward()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(50):
            forward()
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    # glibc's starting thresholds, held (its own adjusting of them depends on the process's history)
    ctypes.CDLL(None).mallopt(-3, 128 * 1024)
    default = faults()
    assert heap.keep_temporaries_in_heap()
    print(default, faults())
""")


@glibc_only
def test_kept_temporaries_are_not_faulted_in_again_on_every_forward():
    # at glibc's starting thresholds each 2 MB block is mapped afresh (all 3,072 pages of a call fault
    # in again); with the thresholds raised they stay in the heap for the next call
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", _TEMPORARIES_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    default, kept = map(int, done.stdout.split())
    assert default > 50 * 1500, f"glibc's thresholds faulted only {default} pages: the case no longer shows it"
    assert kept < default / 10, f"{kept} page faults with the temporaries kept, {default} without"


def test_a_users_malloc_settings_are_kept(monkeypatch):
    calls = []
    monkeypatch.setattr(heap, "_libc_function", lambda *a: lambda *args: calls.append(args) or 1)
    for name, value in [("MALLOC_TRIM_THRESHOLD_", "1000000"), ("GLIBC_TUNABLES", "glibc.malloc.top_pad=0")]:
        with monkeypatch.context() as env:
            env.setenv(name, value)
            heap.keep_temporaries_in_heap.cache_clear()
            assert heap.keep_temporaries_in_heap() is False
    assert not calls
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    for name in heap._USER_MALLOC_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    heap.keep_temporaries_in_heap.cache_clear()
    try:
        assert heap.keep_temporaries_in_heap() is True
        assert heap.keep_temporaries_in_heap() is True and len(calls) == 2  # once per process
        assert calls == [(heap._M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD_BYTES),
                         (heap._M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD_BYTES)]
    finally:
        heap.keep_temporaries_in_heap.cache_clear()


def test_no_mallopt_changes_nothing(monkeypatch):
    monkeypatch.setattr(heap, "_libc_function", lambda *a: None)
    for name in heap._USER_MALLOC_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    heap.keep_temporaries_in_heap.cache_clear()
    try:
        assert heap.keep_temporaries_in_heap() is False
    finally:
        heap.keep_temporaries_in_heap.cache_clear()
