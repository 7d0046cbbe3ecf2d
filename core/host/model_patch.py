"""Per-architecture knowledge, declared as data, picked automatically for a model.

A :class:`ModelPatch` says which blocks to calibrate one at a time, what to leave
alone, what the tracer must treat as opaque, and how to build sample inputs.
Patches come from plugins (``layerwise_register_model_patches``); the model zoo
ships the built-in ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from layerwise.algorithms.quantization.rotation import RotationLayout


@dataclass(frozen=True)
class ModelPatch:
    """Declarative knowledge about one architecture family."""

    name: str
    #: ``config.model_type`` values this patch covers
    model_types: tuple[str, ...] = ()
    #: model class names (``LlamaForCausalLM``); a class match beats a model_type match
    architectures: tuple[str, ...] = ()
    #: module class names (or ``re:`` patterns) calibrated one at a time
    sequential_targets: tuple[str, ...] = ()
    #: modules never compressed (class names, qualified names or ``re:`` patterns)
    ignore: tuple[str, ...] = ()
    #: functions the tracer must call opaquely instead of tracing through
    opaque_functions: tuple[Callable[..., Any], ...] = ()
    #: module class names the tracer keeps as single calls
    leaf_modules: tuple[str, ...] = ()
    #: in-place tweak applied once when the model loads (smallest traceable override)
    apply: Callable[[torch.nn.Module], None] | None = None
    #: context manager active during calibration only (e.g. MoE all-expert routing)
    calibration_context: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None
    #: ``sample_inputs(config, modality) -> dict`` for tracing and tests, no downloads
    sample_inputs: Callable[[Any, str], dict[str, Any]] | None = None
    #: builders of seeded tiny models (random weights, no downloads) of the layouts this patch covers:
    #: what ``layerwise plugins --check`` runs the plugin kit on
    tiny_models: tuple[Callable[[], torch.nn.Module], ...] = ()
    #: SmoothQuant / AWQ (balance layers, smoothed layer) mappings as regex pairs
    smoothing_mappings: tuple[tuple[tuple[str, ...], str], ...] = ()
    #: attention module class names whose keys / values a ``kv_cache_scheme`` quantizes (empty: every module
    #: whose class name ends in ``Attention`` with ``k_proj`` and ``v_proj``)
    attention_modules: tuple[str, ...] = ()
    #: where the residual stream is read and written, for RotationModifier (``None``: the Llama-like layout)
    rotation_layout: RotationLayout | None = None
    #: transformers versions this patch was verified against
    verified_transformers: tuple[str, ...] = field(default_factory=tuple)

    def match_score(self, model: torch.nn.Module) -> int:
        """2 for a class-name match, 1 for a model_type match, 0 for none."""
        if type(model).__name__ in self.architectures:
            return 2
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "model_type", None) in self.model_types:
            return 1
        return 0

    @contextlib.contextmanager
    def calibrating(self, model: torch.nn.Module) -> Iterator[None]:
        """Enter the patch's calibration context, if it has one."""
        if self.calibration_context is None:
            yield
        else:
            with self.calibration_context(model):
                yield
