"""``layer_sequential``: no tracing; the sequential targets run one after another.

1. A check pass on the first batch (before any modifier sees data) records, with
   hooks, the order the targets run in and each one's inputs and output. The
   blocks must form a simple chain: every target called once, target ``i + 1``'s
   first positional argument equal to target ``i``'s output (its first element
   when it returns a tuple), and the other arguments (``attention_mask``,
   ``position_embeddings``, ...) the same for every target. Otherwise the pipeline
   fails with :class:`~layerwise.host.pipeline.PipelineFailed` and nothing was changed.
2. Every batch runs up to the first target, whose inputs are captured (a forward
   pre-hook stops the forward there).
3. Target after target: the batches run through it, its modules are compressed,
   and (with ``propagate_error``) it runs again so the next target sees the
   compressed model's activations.

Modules outside the targets (embeddings, final norm, head) see no calibration
data here; modifiers compress them at ``calibration_end`` if they target them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from layerwise.plugin import Lifecycle
from layerwise.plugin.pipelines import (
    IntermediatesCache,
    ModuleOffloader,
    Pipeline,
    PipelineFailed,
    PipelineOptions,
)

from ._common import (
    calibration_hooks_paused,
    calibration_mode,
    execution_device,
    forward_kwargs,
    progress,
    resolve_targets,
)


class _StopForward(Exception):
    """Raised by the capture hook to end a forward once the first target's inputs are known."""


@dataclass
class _Call:
    args: tuple
    kwargs: dict


def _main(output: Any) -> Any:
    return output[0] if isinstance(output, (tuple, list)) else output


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a is b or a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==
        return False


class LayerSequentialPipeline(Pipeline):
    name = "layer_sequential"

    def run(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], lifecycle: Lifecycle,
            options: PipelineOptions) -> None:
        if not batches:
            raise PipelineFailed("layer_sequential needs at least one calibration batch")
        targets = resolve_targets(model, options.sequential_targets, options.ignore)
        modules = dict(model.named_modules())
        device = execution_device(model, lifecycle, options)
        offloader = ModuleOffloader(model, device, protected=targets)

        with calibration_mode(model, lifecycle):
            order = self._check_chain(model, batches[0], targets, modules, offloader, device)
            cache = IntermediatesCache(options.offload, execution_device=device, offload_dir=options.offload_dir)
            try:
                self._capture(model, batches, modules[order[0]], offloader, device, cache, options)
                with lifecycle.calibrating():
                    self._calibrate(order, modules, offloader, cache, lifecycle, options, len(batches))
            finally:
                cache.close()

    # -- 1. is it a chain? -----------------------------------------------------------------
    def _check_chain(self, model: torch.nn.Module, batch: dict[str, Any], targets: list[str],
                     modules: dict[str, torch.nn.Module], offloader: ModuleOffloader,
                     device: torch.device) -> list[str]:
        """The targets in the order they run; PipelineFailed unless they form a simple chain.

        Compares as the forward goes, holding only the first target's arguments and
        the latest output (not every block's activations).
        """
        order: list[str] = []
        first: list[_Call] = []
        last_output: list[Any] = [None]
        problems: list[str] = []
        onloads: dict[str, Any] = {}

        def stop(problem: str) -> None:
            problems.append(problem)
            raise _StopForward

        def pre(name):
            def hook(module, args, kwargs):
                if name in order:
                    stop(f"target {name!r} runs more than once per forward; the blocks are not a simple chain")
                if not first:
                    if not args or not isinstance(args[0], torch.Tensor):
                        stop(f"target {name!r} does not take its hidden states as the first positional argument")
                    first.append(_Call(args, dict(kwargs)))
                else:
                    prev = order[-1]
                    if not args or not _same(args[0], last_output[0]):
                        stop(f"the input of target {name!r} is not the output of {prev!r}: something runs "
                             "between the blocks, so they are not a simple chain")
                    if not _same(args[1:], first[0].args[1:]) or not _same(dict(kwargs), first[0].kwargs):
                        stop(f"target {name!r} gets other arguments than {order[0]!r} (e.g. a per-layer "
                             "attention mask), so one captured set of arguments cannot feed every block")
                order.append(name)
                onloads[name] = offloader.onloaded([name])
                onloads[name].__enter__()
            return hook

        def post(name):
            def hook(module, args, kwargs, output):
                last_output[0] = _main(output)
                onloads.pop(name).__exit__(None, None, None)
            return hook

        handles = []
        try:
            for name in targets:
                handles.append(modules[name].register_forward_pre_hook(pre(name), with_kwargs=True))
                handles.append(modules[name].register_forward_hook(post(name), with_kwargs=True))
            with offloader.onloaded([""]):
                try:
                    model(**forward_kwargs(model, batch, device))
                except _StopForward:
                    pass
        finally:
            for handle in handles:
                handle.remove()
            for cm in onloads.values():
                cm.__exit__(None, None, None)
        if problems:
            raise PipelineFailed(problems[0])
        if not order:
            raise PipelineFailed(f"no sequential target ({', '.join(targets[:3])}, ...) ran in the forward pass")
        return order

    # -- 2. inputs of the first target ---------------------------------------------------------
    def _capture(self, model: torch.nn.Module, batches: Sequence[dict[str, Any]], first: torch.nn.Module,
                 offloader: ModuleOffloader, device: torch.device, cache: IntermediatesCache,
                 options: PipelineOptions) -> None:
        captured: list[tuple[tuple, dict]] = []

        def hook(module, args, kwargs):
            captured.append((args, dict(kwargs)))
            raise _StopForward

        handle = first.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            with offloader.onloaded([""]):
                for index, batch in enumerate(progress(batches, "capturing inputs", options.show_progress)):
                    captured.clear()
                    try:
                        model(**forward_kwargs(model, batch, device))
                    except _StopForward:
                        pass
                    if not captured:
                        raise PipelineFailed("the first sequential target did not run for batch "
                                             f"{index}")
                    args, kwargs = captured[0]
                    cache.update(index, {"hidden": args[0], "args": args[1:], "kwargs": kwargs})
        finally:
            handle.remove()

    # -- 3. target after target ------------------------------------------------------------
    def _calibrate(self, order: list[str], modules: dict[str, torch.nn.Module], offloader: ModuleOffloader,
                   cache: IntermediatesCache, lifecycle: Lifecycle, options: PipelineOptions,
                   num_batches: int) -> None:
        def run_target(target: torch.nn.Module, index: int) -> Any:
            values = cache.fetch(index, ["hidden", "args", "kwargs"])
            return _main(target(values["hidden"], *values["args"], **values["kwargs"]))

        last = len(order) - 1
        for position, name in enumerate(progress(order, "calibrating targets", options.show_progress)):
            target = modules[name]
            with offloader.onloaded([name]):
                keep = position < last and not options.propagate_error
                for i in range(num_batches):
                    output = run_target(target, i)
                    if keep:  # the uncompressed block's output feeds the next block
                        cache.put(i, "next", output)
                lifecycle.sequential_epoch_end([name])
                if position == last:
                    continue
                if options.propagate_error:  # re-run with the compressed weights, unobserved
                    with calibration_hooks_paused(lifecycle):
                        for i in range(num_batches):
                            cache.put(i, "hidden", run_target(target, i))
                else:
                    cache.rename("next", "hidden")
