"""What every built-in pipeline shares: the calibration context, devices, targets, progress."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from layerwise.plugin import Lifecycle, matches
from layerwise.plugin.pipelines import PipelineFailed, PipelineOptions, canonical, move_to


def execution_device(model: torch.nn.Module, lifecycle: Lifecycle, options: PipelineOptions) -> torch.device:
    """Where calibration runs: the options', else the state's, else where the weights are."""
    if options.execution_device is not None:
        return canonical(options.execution_device)
    state_device = getattr(lifecycle.state, "execution_device", None)
    if state_device is not None:
        return canonical(state_device)
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


@contextlib.contextmanager
def calibration_mode(model: torch.nn.Module, lifecycle: Lifecycle) -> Iterator[None]:
    """No autograd, no KV cache, and the model patch's calibration context (if any)."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(_no_kv_cache(model))
        patch = getattr(lifecycle.state, "patch", None)
        if patch is not None:
            stack.enter_context(patch.calibrating(model))
        yield


@contextlib.contextmanager
def _no_kv_cache(model: torch.nn.Module) -> Iterator[None]:
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "use_cache"):
        yield
        return
    before = config.use_cache
    config.use_cache = False
    try:
        yield
    finally:
        config.use_cache = before


def accepts_use_cache(model: torch.nn.Module) -> bool:
    """Does the model's forward take ``use_cache`` by name (not only through ``**kwargs``)?"""
    try:
        return "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def forward_kwargs(model: torch.nn.Module, batch: Mapping[str, Any], device: torch.device | None) -> dict[str, Any]:
    """One batch as keyword arguments of ``model``'s forward, on ``device``, KV cache off."""
    kwargs = dict(move_to(dict(batch), device))
    if accepts_use_cache(model):
        kwargs.setdefault("use_cache", False)
    return kwargs


def all_module_names(model: torch.nn.Module) -> list[str]:
    """Qualified names of every submodule (what a whole-model pipeline calibrates at once)."""
    return [name for name, _ in model.named_modules() if name]


def resolve_targets(model: torch.nn.Module, patterns: Iterable[str], ignore: Iterable[str] = ()) -> list[str]:
    """Qualified names of the outermost modules matching ``patterns`` and not ``ignore`` (definition order).

    Empty patterns fall back to ``_no_split_modules``, then the blocks found by structure (as the tracer does).
    """
    from layerwise.plugin.pipelines import TargetError, default_targets

    ignore = list(ignore)
    try:
        patterns = list(patterns) or default_targets(model)
    except TargetError as exc:
        raise PipelineFailed(str(exc)) from exc
    found: list[str] = []
    for name, module in model.named_modules():
        if not name or not matches(name, module, patterns) or matches(name, module, ignore):
            continue
        if any(name.startswith(parent + ".") for parent in found):
            continue
        found.append(name)
    if not found:
        raise PipelineFailed(f"sequential targets {patterns} match no module of {type(model).__name__}")
    return found


def progress(items: Iterable[Any], desc: str, enabled: bool, total: int | None = None) -> Iterable[Any]:
    """``items`` with a tqdm bar when ``enabled`` and stderr is a terminal (redirected to a log, a bar would write
    a line per update)."""
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        return items
    return tqdm(items, desc=desc, total=total, leave=False, disable=None)  # None: off where stderr is no terminal


#: errors that are never turned into "this pipeline cannot handle the model"
FATAL_ERRORS: tuple[type[BaseException], ...] = (torch.OutOfMemoryError, torch.cuda.OutOfMemoryError, MemoryError,
                                                 KeyboardInterrupt)


@contextlib.contextmanager
def calibration_hooks_paused(lifecycle: Lifecycle) -> Iterator[None]:
    """The modifiers' hooks do not fire inside the block (the error-propagation re-run).

    A re-run only produces the next piece's inputs; letting calibration hooks see it
    would count every batch twice (e.g. GPTQ Hessians). Handles stay valid: each hook
    goes back into its module's hook table on exit, at its place: a table runs its hooks
    in registration order (handle ids grow with it), and a hook registered meanwhile (the
    pipeline's early stop) must still run after the modifiers' hooks registered before it.
    """
    stashed: list[tuple[dict, int, Any]] = []
    for modifier in lifecycle.modifiers:
        for handle in list(getattr(modifier, "_hooks", ())):
            table = handle.hooks_dict_ref()
            if table is not None and handle.id in table:
                stashed.append((table, handle.id, table.pop(handle.id)))
    try:
        yield
    finally:
        tables = {id(table): table for table, _, _ in stashed}
        for table, key, hook in stashed:
            table[key] = hook
        for table in tables.values():
            ordered = sorted(table.items(), key=lambda item: item[0])
            table.clear()
            table.update(ordered)
