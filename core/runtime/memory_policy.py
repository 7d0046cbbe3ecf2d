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
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(getattr(config, "text_config", None), "hidden_size", 0)
    tokens = sum(int(v.numel()) for batch in batches for k, v in batch.items()
                 if k == "input_ids" and isinstance(v, torch.Tensor))
    element = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    estimate = 3 * tokens * int(hidden or 0) * element
    free = available_memory()
    if free is not None and estimate > CACHE_MEMORY_SHARE * free:
        note = f"disk (auto: ~{estimate / 2**30:.1f} GiB of activations, {free / 2**30:.1f} GiB memory available)"
        log.info("layerwise: cached activations go to disk: %s", note)
        return "disk", note
    return "cpu", "cpu"
