"""The extension contract: every hook a layerwise plugin can implement.

A plugin is a module (or object) exposed through the ``layerwise`` entry-point
group whose functions are marked with :data:`hookimpl`. Every ``register_*`` hook
receives a ``register`` callback; calling it adds one named thing to the host's
registry, attributed to the plugin's distribution. Hooks are order independent:
two plugins registering the same name is an error naming both distributions.

Example::

    from layerwise import hookimpl

    @hookimpl
    def layerwise_register_modifiers(register):
        register("MyModifier", MyModifier)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT = "layerwise"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)

Register = Callable[..., None]


@hookspec
def layerwise_register_pipelines(register: Register) -> None:
    """Register calibration pipelines: ``register(name, PipelineClass)``."""


@hookspec
def layerwise_register_modifiers(register: Register) -> None:
    """Register modifiers (compression algorithms) usable in recipes: ``register(name, ModifierClass)``."""


@hookspec
def layerwise_register_model_patches(register: Register) -> None:
    """Register per-architecture knowledge: ``register(ModelPatch(...))``."""


@hookspec
def layerwise_register_observers(register: Register) -> None:
    """Register range observers for quantization: ``register(name, ObserverClass)``."""


@hookspec
def layerwise_register_datasets(register: Register) -> None:
    """Register calibration-data loaders: ``register(name, loader)``; a loader turns a source into samples."""


@hookspec
def layerwise_register_savers(register: Register) -> None:
    """Register output formats: ``register(name, saver)``, a :class:`~layerwise.host.saver.Saver` instance
    (or a function ``fn(model, output_dir, *, tokenizer, recipe, extra_files, overwrite)``, wrapped in one)."""


@hookspec
def layerwise_select_pipeline(model: Any, modifiers: list[Any]) -> str | None:
    """Return a registered pipeline name to override the host's default choice, or ``None`` to abstain.

    Every plugin is asked (order does not matter): two plugins choosing different pipelines
    for one model is a ``PluginError`` naming both; a choice that raises or names no
    registered pipeline is ignored with a warning (an error with ``LAYERWISE_STRICT_PLUGINS=1``).
    """
