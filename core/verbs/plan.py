"""``plan()``: what ``compress()`` with the same arguments would do, told in seconds, without reading weights.

``compress()`` runs :func:`preflight` first (the same checks, no timing), so a run the plan says
will fail never starts.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from layerwise.host.recipe import RecipeLike
from layerwise.model_io.saving import Overwrite
from layerwise.planning.plan import Plan, PlanError, make_plan
from layerwise.verbs.options import CompressOptions, with_everyday

log = logging.getLogger("layerwise")

__all__ = ["Plan", "PlanError", "plan", "preflight"]


def plan(model: torch.nn.Module | str | os.PathLike, recipe: RecipeLike = "W4A16", dataset: Any = None, *,
         output_dir: str | os.PathLike | None = None, num_calibration_samples: int | None = None,
         max_seq_length: int | None = None, device: str | torch.device | None = None,
         overwrite: Overwrite | None = None, options: CompressOptions | None = None,
         gpu_memory: int | None = None, host_memory: int | None = None, serve_on: str | None = None) -> Plan:
    """The plan of ``compress()`` called with the same arguments; ``plan.ok`` is the verdict.

    ``gpu_memory`` / ``host_memory`` (bytes) plan for a machine other than this one, ``serve_on``
    names the GPU the output will be served on (``H100``, ``A100``, ``L4``, ...). The model is built
    on the meta device from its config; no weight is read.
    """
    options = with_everyday(options or CompressOptions(), num_calibration_samples, max_seq_length,
                            None if device is None else str(device), overwrite)
    return make_plan(model, recipe, dataset, options=options, output_dir=output_dir, gpu_memory=gpu_memory,
                     host_memory=host_memory, serve_on=serve_on)


def preflight(model: Any, recipe: RecipeLike, dataset: Any, options: CompressOptions,
              output_dir: str | os.PathLike | None) -> Plan | None:
    """``compress()``'s first step: the plan's checks on a model folder, a :class:`PlanError` listing what
    would fail (a placement that does not fit only when both ``weights`` and ``offload`` were chosen, not
    ``auto``, and the GPU's need only where it is known). A loaded module is checked by the run itself; a model the plan cannot build on meta
    (a hub id, a config transformers cannot build) is left to the run, logged."""
    if isinstance(model, torch.nn.Module) or not os.path.isdir(os.path.expanduser(str(model))):
        return None
    try:
        found = make_plan(model, recipe, dataset, options=options, output_dir=output_dir, measure=False)
    except PlanError:
        raise
    except Exception as exc:  # noqa: BLE001 - the plan is a forecast; the run gives the precise error
        log.info("layerwise: no plan for %s (%s: %s); the run checks as it goes", model, type(exc).__name__, exc)
        return None
    # a placement that does not fit stops the run only when the user chose it: ``auto`` adapts as it goes
    explicit = options.placement.weights != "auto" and options.placement.offload != "auto"
    errors = [f for f in found.findings if f.level == "error" and (f.topic != "memory" or explicit)]
    if errors and errors[0].exception is not None:
        raise errors[0].exception  # what the run would raise, an hour sooner
    if errors:
        raise PlanError("the run would fail: " + "; ".join(f.text for f in errors)
                        + " (`layerwise plan` shows the whole plan)")
    return found
