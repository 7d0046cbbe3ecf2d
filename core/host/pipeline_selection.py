"""Choosing the calibration pipeline and falling back when one cannot handle a model.

The choice, in order:

1. a pipeline the user named -- used as is; if it fails, its error is raised;
2. ``datafree`` when no modifier needs data (``requires_data is False`` for all);
3. a plugin's choice (``layerwise_select_pipeline``), followed by the default chain;
4. the default chain ``sequential`` -> ``layer_sequential`` -> ``basic``; ``compress()``
   leaves ``basic`` out when the user named sequential targets (calibrating the whole model
   at once would silently drop what they asked for).

Along a chain, a pipeline that raises :class:`~layerwise.host.pipeline.PipelineFailed`
(e.g. the model cannot be traced) is reported with a :class:`PipelineFallbackWarning`
naming it and the reason, and the next one runs (a :class:`DeviceErrorFallbackWarning`, also a
:class:`~layerwise.runtime.devices.DeviceErrorWarning`, saying it is a bug when the reason is a tensor
on the wrong device). Inside :func:`recording_fallbacks` the
messages are also collected, whatever the warning filters say (``compress()`` puts them in
its report). Out-of-memory errors, ``MemoryError``
and ``KeyboardInterrupt`` are never caught. A pipeline that fails *after* modifiers
compressed some weights is not replaced either (the model is half done): that raises
:class:`PipelineAborted`.

``compress()`` calls::

    used = run_pipeline(model, batches, lifecycle, options, requested=pipeline)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch

from layerwise.common.user_warnings import warn_user
from layerwise.errors import InvalidArgumentError, LayerwiseError
from layerwise.host.lifecycle import Lifecycle
from layerwise.host.pipeline import PipelineFailed, PipelineOptions
from layerwise.host.plugin_manager import get_host, registry
from layerwise.runtime.devices import DeviceErrorWarning, device_error_note, is_device_error

DEFAULT_CHAIN: tuple[str, ...] = ("sequential", "layer_sequential", "basic")
DATAFREE = "datafree"


class PipelineFallbackWarning(UserWarning):
    """A pipeline could not handle the model; the next one in the chain runs."""


class DeviceErrorFallbackWarning(PipelineFallbackWarning, DeviceErrorWarning):
    """A pipeline fell back because a tensor sat on the wrong device: a bug (both filters catch it)."""


class PipelineAborted(LayerwiseError, RuntimeError):
    """A pipeline failed after weights were already compressed; no other pipeline may take over."""


#: the lists that collect fallback messages, innermost last (see :func:`recording_fallbacks`)
_recorders: ContextVar[tuple[list[str], ...]] = ContextVar("layerwise_fallback_recorders", default=())


@contextlib.contextmanager
def recording_fallbacks() -> Iterator[list[str]]:
    """Collect the message of every fallback inside the block into the list it yields.

    Not through ``warnings``: a filter that ignores :class:`PipelineFallbackWarning`, or the
    once-per-message default, must not make a run's report say that nothing fell back.
    """
    messages: list[str] = []
    token = _recorders.set((*_recorders.get(), messages))
    try:
        yield messages
    finally:
        _recorders.reset(token)


def check_requested_pipeline(requested: str | None, modifiers: Sequence[Any]) -> None:
    """A pipeline the user named exists (an unknown name lists the registered ones) and, when a modifier needs
    calibration data, runs data: before the model loads, not as a 'saw no data' error after calibration."""
    if requested is None:
        return
    pipeline = registry("pipelines").get(requested)
    needing = [type(m).__name__ for m in modifiers if getattr(m, "requires_data", True)]
    if needing and not getattr(pipeline, "runs_data", True):
        raise InvalidArgumentError(f"pipeline {requested!r} runs no calibration data, and {', '.join(needing)} needs "
                                   f"it: leave the pipeline to layerwise (drop --pipeline / pipeline=) or name one "
                                   f"that calibrates (sequential, layer_sequential, basic)")


def select_pipeline(model: torch.nn.Module, modifiers: Sequence[Any], requested: str | None = None) -> list[str]:
    """The pipelines to try, in order (see the module docstring)."""
    if requested:
        return [requested]
    if all(getattr(m, "requires_data", True) is False for m in modifiers):
        return [DATAFREE]
    chosen = get_host().select_pipeline(model, list(modifiers))
    if chosen:
        return [chosen, *(name for name in DEFAULT_CHAIN if name != chosen)]
    return list(DEFAULT_CHAIN)


def run_pipeline(model: torch.nn.Module, batches: Sequence[dict[str, Any]], lifecycle: Lifecycle,
                 options: PipelineOptions | None = None, requested: str | None = None, *,
                 exclude: Sequence[str] = ()) -> str:
    """Calibrate ``model`` with the selected pipeline chain; returns the name of the one that ran.

    ``exclude`` drops pipelines from an automatic chain (``independent`` uses it to never pick itself).
    """
    options = options or PipelineOptions()
    chain = [n for n in select_pipeline(model, lifecycle.modifiers, requested) if requested or n not in exclude]
    if not chain:
        raise PipelineFailed(f"no pipeline left to try (excluded: {', '.join(exclude)})")
    pipelines = registry("pipelines")
    for position, name in enumerate(chain):
        pipeline = pipelines.get(name)()  # an unknown name lists the registered ones
        watched = _WatchedLifecycle(lifecycle)
        try:
            pipeline.run(model, batches, watched, options)
            return name
        except PipelineFailed as exc:
            if requested:  # the user's choice is never silently replaced
                raise PipelineFailed(
                    f"pipeline {name!r}, asked for by name, cannot calibrate {type(model).__name__}: {exc}. "
                    f"Leave out pipeline= (CLI: --pipeline) to let layerwise pick one and fall back, "
                    f"or fix the cause") from exc
            if watched.compression_started:
                raise PipelineAborted(
                    f"pipeline {name!r} failed after compressing part of the model ({exc}); not falling back "
                    f"because the weights were already changed. Reload the model and pass pipeline='basic' "
                    f"or fix the cause") from exc
            if position == len(chain) - 1:
                raise
            following = chain[position + 1]
            message = (f"pipeline {name!r} cannot calibrate {type(model).__name__}, falling back to {following!r}. "
                       f"Why: {exc}")
            device_error = is_device_error(exc)
            if device_error:
                message += f". {device_error_note(f'Pipeline {name!r}')}"
            for messages in _recorders.get():
                messages.append(message)
            warn_user(message, DeviceErrorFallbackWarning if device_error else PipelineFallbackWarning)
    raise AssertionError("unreachable")  # pragma: no cover


class _WatchedLifecycle:
    """A view of a :class:`Lifecycle` that remembers whether any compression event fired."""

    def __init__(self, inner: Lifecycle) -> None:
        self._inner = inner
        self.compression_started = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sequential_epoch_end(self, modules: list[str]) -> None:
        self.compression_started = True
        self._inner.sequential_epoch_end(modules)

    def calibration_end(self) -> None:
        self.compression_started = True
        self._inner.calibration_end()

    @contextlib.contextmanager
    def calibrating(self) -> Iterator[_WatchedLifecycle]:
        self._inner.calibration_start()
        try:
            yield self
        except BaseException:
            self._inner.remove_hooks()
            raise
        self.calibration_end()
