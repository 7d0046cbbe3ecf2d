"""Where a run keeps its weights and cached activations on the execution device: a plan made once.

On a GPU with room to spare, moving each piece's weights in and out, and every cached activation
back to CPU memory after its piece, is most of a run's time (a 1B model: 14,369 synchronous copies,
6.5 s of 30 s). :func:`plan_placement` decides, from the device's free memory, what stays there:

* **the weights**, moved once for the whole run, when they plus one piece's working set fit under
  ``fraction`` of the free memory (:data:`DEVICE_MEMORY_FRACTION`); else each piece is onloaded
  around its calibration, as before;
* **the cached activations**, kept on the device up to the budget left after that (the weights
  moved, or the largest piece's, and the working set); beyond it they spill to CPU memory, pinned
  on CUDA so that their copies run asynchronously (:class:`~layerwise.runtime.cache.IntermediatesCache`).

A piece's working set is estimated as its weights plus :data:`WORKING_SET_FACTOR` times the widest
activation of the largest batch (tokens x the widest layer output, float32): a forward's temporaries,
attention scores and the modifiers' statistics. Where the execution device is the CPU, or its free
memory is not known, nothing is planned: weights and activations rest where they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from layerwise.runtime.devices import free_memory

__all__ = ["DEVICE_MEMORY_FRACTION", "WORKING_SET_FACTOR", "Placement", "plan_placement", "working_set_bytes"]

#: the share of the device's free memory a run plans to use (the rest: the allocator's slack, other processes)
DEVICE_MEMORY_FRACTION = 0.8
#: a piece's temporaries, as a multiple of its widest activation (see the module docstring)
WORKING_SET_FACTOR = 16


def working_set_bytes(tokens: int, widest: int) -> int:
    """A piece's temporaries: :data:`WORKING_SET_FACTOR` times its widest activation (``tokens`` x ``widest``
    values, float32), the rule the run places by and the plan forecasts with."""
    return WORKING_SET_FACTOR * tokens * widest * 4


@dataclass(frozen=True)
class Placement:
    """What rests on the execution device during a run, and why."""

    #: the weights are moved to the device once, for the whole run (else: piece by piece)
    weights_moved: bool = False
    #: bytes of cached activations kept on the device (0: every cached value rests on the offload device)
    cache_budget: int = 0
    #: one line for the run report
    reason: str = ""


def plan_placement(device: torch.device, weight_bytes: int, piece_weight_bytes: int, working_set: int,
                   free_bytes: int | None = None, fraction: float = DEVICE_MEMORY_FRACTION,
                   can_move: bool = True) -> Placement:
    """The plan for ``weight_bytes`` of weights whose largest piece holds ``piece_weight_bytes``, with a piece's
    temporaries ``working_set``, on ``device`` with ``free_bytes`` free (``None``: asked of the device).
    ``can_move=False`` (weights streamed from disk): the weights are onloaded piece by piece whatever fits."""
    if device.type == "cpu":
        return Placement(reason="the execution device is the CPU: weights and activations stay where they rest")
    free = free_memory(device) if free_bytes is None else free_bytes
    if free is None:
        return Placement(reason=f"the free memory of {device} is not known: weights onloaded piece by piece, "
                                f"activations cached on the CPU")
    usable = int(free * fraction)
    moved = can_move and weight_bytes + working_set <= usable
    resident = weight_bytes if moved else piece_weight_bytes
    budget = max(0, usable - resident - working_set)
    weights = (f"weights moved to {device} once ({_gib(weight_bytes)})" if moved else
               "weights onloaded piece by piece (streamed from disk)" if not can_move else
               f"weights onloaded piece by piece ({_gib(weight_bytes)} > {fraction:.0%} of {_gib(free)} free, "
               f"less a piece's working set)")
    return Placement(moved, budget, f"{weights}; cached activations on {device} up to {_gib(budget)}, "
                                    f"beyond that in CPU memory")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB"
