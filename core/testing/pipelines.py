"""``check_pipeline``: what the host assumes of every calibration pipeline, checked step by step.

A recording modifier (it reads every Linear's inputs and changes nothing) is calibrated through
the pipeline, asked for by name, on a seeded tiny Llama:

1. **registered**: the class is in the pipelines registry, a :class:`~layerwise.host.pipeline.Pipeline`;
2. **events**: initialize, calibration_start, one or more sequential_epoch_end (each naming
   modules of the model), calibration_end, finalize, in that order;
3. **every sample**: each Linear's inputs reach the modifier for every calibration sample;
4. **nothing changed**: a modifier that changes nothing leaves the model's outputs as they were
   (a pipeline moves data; it never edits weights), and no hook is left on the model;
5. **errors propagate**: a forward failing mid-calibration reaches the caller, and leaves no hook.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from layerwise.common.matching import find_modules
from layerwise.host.modifier import Modifier
from layerwise.host.pipeline import Pipeline

from .errors import PluginCheckError
from .modifiers import count_hooks, tiny_llama, token_batches

CHECK = "check_pipeline"


@dataclass
class _Recorder(Modifier):
    """Reads every Linear's inputs and the events; compresses nothing."""

    events: list[str] = field(default_factory=list)
    samples: dict[str, int] = field(default_factory=dict)
    epoch_modules: list[list[str]] = field(default_factory=list)
    hooked: set[str] = field(default_factory=set)

    def on_initialize(self, state) -> None:
        self.events.append("initialize")

    def on_calibration_start(self, state) -> None:
        self.events.append("calibration_start")
        for name, module in find_modules(state.model, ["Linear"], state.ignore).items():
            if isinstance(module, torch.nn.Linear):
                self.hooked.add(name)
                self.register_hook(module, lambda m, args, n=name: self._count(n, args[0]), "forward_pre")

    def _count(self, name: str, x: torch.Tensor) -> None:
        self.samples[name] = self.samples.get(name, 0) + (x.shape[0] if x.dim() > 2 else 1)

    def on_sequential_epoch_end(self, state, modules: list[str]) -> None:
        self.events.append("sequential_epoch_end")
        self.epoch_modules.append(list(modules))

    def on_calibration_end(self, state) -> None:
        self.events.append("calibration_end")

    def on_finalize(self, state) -> None:
        self.events.append("finalize")


def check_pipeline(pipeline: type[Pipeline] | str, *, model_factory: Callable[[], torch.nn.Module] = tiny_llama,
                   batches: list[Any] | None = None) -> None:
    """Run every check on ``pipeline`` (the class or its registered name); raises :class:`PluginCheckError`."""
    name, cls = _registered(pipeline)
    batches = token_batches() if batches is None else batches
    _check_run(name, model_factory, batches, cls.runs_data)
    if cls.runs_data:
        _check_error_propagates(name, model_factory, batches)


def _fail(name: str, step: str, problem: str, fix: str = "") -> PluginCheckError:
    return PluginCheckError(CHECK, name, step, problem, fix)


def _registered(pipeline: type[Pipeline] | str) -> tuple[str, type[Pipeline]]:
    from layerwise.host.plugin_manager import registry

    found = dict(registry("pipelines").items())
    if isinstance(pipeline, str):
        if pipeline not in found:
            raise _fail(pipeline, "registered", f"no pipeline of that name; registered: {sorted(found)}")
        pipeline = found[pipeline]
    names = [n for n, cls in found.items() if cls is pipeline]
    label = getattr(pipeline, "__name__", repr(pipeline))
    if not names:
        raise _fail(label, "registered", "the class is not in the pipelines registry, so compress() cannot pick it",
                    "register it from a layerwise_register_pipelines hookimpl (GUIDE.md section 7)")
    if not (isinstance(pipeline, type) and issubclass(pipeline, Pipeline)):
        raise _fail(names[0], "registered", "a pipeline must subclass layerwise.host.pipeline.Pipeline")
    return names[0], pipeline


def _outputs(model: torch.nn.Module, batches: list[Any]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(**batch).logits for batch in batches]


class _DataFreeRecorder(_Recorder):
    """The recorder for a pipeline that runs no data: its events only (no sample reaches anything)."""

    requires_data = False


def _check_run(name: str, model_factory: Callable[[], torch.nn.Module], batches: list[Any], runs_data: bool) -> None:
    import layerwise

    model = model_factory()
    reference = copy.deepcopy(model)
    before = count_hooks(model)
    recorder = _Recorder() if runs_data else _DataFreeRecorder()  # a pipeline that runs no data takes no such modifier
    try:
        layerwise.compress(model, [recorder], dataset=batches if runs_data else None, show_progress=False,
                           options=layerwise.CompressOptions.of(pipeline=name))
    except Exception as error:
        raise _fail(name, "events", f"compress() failed: {type(error).__name__}: {error}") from error
    epochs = recorder.events.count("sequential_epoch_end")
    expected = ["initialize", "calibration_start", *["sequential_epoch_end"] * epochs, "calibration_end", "finalize"]
    if not epochs or recorder.events != expected:
        raise _fail(name, "events", f"events came as {recorder.events}",
                    "fire calibration_start, sequential_epoch_end per piece (at least one), calibration_end")
    names = {n for n, _ in model.named_modules()}
    stray = sorted({m for modules in recorder.epoch_modules for m in modules} - names)
    if stray:
        raise _fail(name, "events", f"sequential_epoch_end names modules the model does not have: {stray[:3]}")
    samples = sum(next(iter(b.values())).shape[0] for b in batches)
    short = {n: c for n, c in recorder.samples.items() if c < samples}
    missing = sorted(recorder.hooked - set(recorder.samples))
    if runs_data and (short or missing):
        shown = ", ".join(f"{n}: {c} of {samples}" for n, c in list(short.items())[:3]) or f"never: {missing[:3]}"
        raise _fail(name, "every sample", f"Linear inputs did not reach the modifier for every sample ({shown})",
                    "run every batch through every piece")
    difference = max((a - b).abs().max().item() for a, b in zip(_outputs(model, batches), _outputs(reference, batches)))
    if difference > 1e-6:
        raise _fail(name, "nothing changed", f"with a modifier that changes nothing, outputs moved by {difference:.3g}",
                    "a pipeline moves data through the model; it must not edit weights or buffers")
    left = count_hooks(model) - before
    if left:
        raise _fail(name, "nothing changed", f"{left} hook(s) left on the model", "remove every hook the pipeline "
                    "registers (a try/finally around the run)")


class _InjectedFailure(RuntimeError):
    """The error the check raises inside calibration."""


def _check_error_propagates(name: str, model_factory: Callable[[], torch.nn.Module], batches: list[Any]) -> None:
    import layerwise

    model = model_factory()
    before = count_hooks(model)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    calls = {"n": 0}

    def fail_later(module: torch.nn.Module, args: Any) -> None:
        calls["n"] += 1
        if calls["n"] > 1:
            raise _InjectedFailure("layerwise.testing: a forward failing mid-calibration")

    injected = linears[len(linears) // 2].register_forward_pre_hook(fail_later)
    try:
        layerwise.compress(model, [_Recorder()], dataset=batches, show_progress=False, options=layerwise.CompressOptions.of(pipeline=name))
    except Exception as error:
        chain, cause = [], error
        while cause is not None:
            chain.append(cause)
            cause = cause.__cause__ or cause.__context__
        if not any(isinstance(e, _InjectedFailure) for e in chain):
            raise _fail(name, "errors propagate", f"a forward's error became {type(error).__name__}: {error}, "
                        f"without the original as its cause", "re-raise, or raise from the original") from error
    else:
        raise _fail(name, "errors propagate", "compress() succeeded although a forward raised mid-calibration",
                    "do not catch exceptions around model forwards")
    finally:
        injected.remove()
    left = count_hooks(model) - before
    if left:
        raise _fail(name, "errors propagate", f"{left} hook(s) left on the model after a failed run",
                    "remove hooks in a finally block")
