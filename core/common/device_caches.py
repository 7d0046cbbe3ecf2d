"""Caches keyed by a device: what a function made on it (a constant table, a matrix) or found it can do.

A simulated device (:func:`layerwise.testing.simulated_device`) is the CPU standing in for ``cuda:0``: what a
function caches under it is a CPU tensor that only that simulation counts as on the device, filed under the
real device's name. A later simulation would be handed a CPU tensor, and so would a real GPU in the same
process. A function cached with :func:`device_cache` instead of :func:`functools.lru_cache` is emptied by
:func:`clear_device_caches`, which a simulation calls as it starts and as it ends.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: every function cached with :func:`device_cache`
_CACHES: list[functools._lru_cache_wrapper[Any]] = []


def device_cache(maxsize: int | None = None) -> Callable[[Callable[..., T]], functools._lru_cache_wrapper[T]]:
    """:func:`functools.lru_cache` (``maxsize``; ``None``: unbounded) for a function of a device, emptied by
    :func:`clear_device_caches`."""
    def wrap(function: Callable[..., T]) -> functools._lru_cache_wrapper[T]:
        cached = functools.lru_cache(maxsize=maxsize)(function)
        _CACHES.append(cached)
        return cached
    return wrap


def clear_device_caches() -> None:
    """Empty every cache made with :func:`device_cache`."""
    for cached in _CACHES:
        cached.cache_clear()
