"""Choices made from the memory a machine has: where cached activations rest when asked for ``auto``."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

log = logging.getLogger("layerwise")

#: share of the available memory the activation cache may take before ``offload="auto"`` puts it on disk
CACHE_MEMORY_SHARE = 0.5


def available_memory() -> int | None:
    """Bytes of memory this process could still use (Linux MemAvailable), ``None`` when unknown."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def choose_offload(offload: str, model: torch.nn.Module, batches: list[dict[str, Any]]) -> tuple[str, str]:
    """Where cached activations rest, and the note the report gives: ``auto`` becomes disk when the cache
    at a cut (about three hidden-state-sized values per token) would not fit in half the available memory."""
    if offload != "auto":
        return offload, offload
    tokens = sum(int(v.numel()) for batch in batches for k, v in batch.items()
                 if k == "input_ids" and isinstance(v, torch.Tensor))
    element = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    estimate = cache_bytes(tokens, hidden_size(getattr(model, "config", None)), element)
    free = available_memory()
    if offload_to_disk(estimate, free):
        note = f"disk (auto: ~{estimate / 2**30:.1f} GiB of activations, {free / 2**30:.1f} GiB memory available)"
        log.info("layerwise: cached activations go to disk: %s", note)
        return "disk", note
    return "cpu", "cpu"


#: values cached per token at a cut, in hidden-state widths (the hidden states, and what travels beside them)
CACHED_VALUES_PER_TOKEN = 3


def hidden_size(config: Any) -> int:
    """The model's hidden width (its text part's for a multimodal config), 0 when unknown."""
    hidden = getattr(config, "hidden_size", None) or getattr(getattr(config, "text_config", None), "hidden_size", 0)
    return int(hidden or 0)


def cache_bytes(tokens: int, hidden: int, element: int) -> int:
    """The activation cache at one cut: :data:`CACHED_VALUES_PER_TOKEN` hidden-state values per token."""
    return CACHED_VALUES_PER_TOKEN * tokens * hidden * element


def offload_to_disk(cache: int, free: int | None) -> bool:
    """``offload="auto"``'s rule: disk when the cache would take more than :data:`CACHE_MEMORY_SHARE` of ``free``."""
    return free is not None and cache > CACHE_MEMORY_SHARE * free
