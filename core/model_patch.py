"""Per-architecture knowledge, declared as data, picked automatically for a model.

A :class:`ModelPatch` says which blocks to calibrate one at a time, what to leave
alone, what the tracer must treat as opaque, and how to build sample inputs.
Patches come from plugins (``layerwise_register_model_patches``); the model zoo
ships the built-in ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import UnknownNameError


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


def find_patch(model: torch.nn.Module, patches: Sequence[ModelPatch] | None = None) -> ModelPatch | None:
    """The registered patch that best matches ``model``, or ``None``."""
    if patches is None:
        from .plugin_manager import registry

        patches = [p for _, p in registry("model_patches").items()]
    scored = [(p.match_score(model), p) for p in patches]
    best = max((s for s, _ in scored), default=0)
    return next((p for s, p in scored if s == best), None) if best else None


def resolve_patch(model: torch.nn.Module, patch: ModelPatch | str | bool | None = None) -> ModelPatch | None:
    """Turn the user's ``patch=`` argument into a patch.

    ``None``/``True``: pick automatically; ``False``: no patch; a name: that registered
    patch; a :class:`ModelPatch`: used as is.
    """
    if patch is None or patch is True:
        return find_patch(model)
    if patch is False:
        return None
    if isinstance(patch, ModelPatch):
        return patch
    if isinstance(patch, str):
        from .plugin_manager import registry

        return registry("model_patches").get(patch)
    raise UnknownNameError("model patch", repr(patch), [], hint="pass a name, a ModelPatch, True or False")


def apply_patch(model: torch.nn.Module, patch: ModelPatch | None) -> torch.nn.Module:
    """Apply ``patch`` to ``model`` once and remember it on the model."""
    if patch is None or getattr(model, "_layerwise_patch", None) is patch:
        return model
    if patch.apply is not None:
        patch.apply(model)
    model._layerwise_patch = patch  # type: ignore[attr-defined]
    return model


def use_patch(model: torch.nn.Module, patch: ModelPatch | str | bool | None = None) -> ModelPatch | None:
    """Resolve ``patch`` for ``model`` (``None``: the one already applied, else the registered match),
    apply it, and return it: what ``compress()`` and ``trace()`` both do with their ``patch=``."""
    chosen = getattr(model, "_layerwise_patch", None) if patch is None else None
    chosen = chosen or resolve_patch(model, patch)
    apply_patch(model, chosen)
    return chosen
