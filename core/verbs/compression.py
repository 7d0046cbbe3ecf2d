"""``compress()``: the one verb. Check what the user typed, load, calibrate, save, report.

Everything that can be wrong with the arguments is found before the model loads (a typo costs
a second, not an hour); the run's settings arrive once as a frozen
:class:`~layerwise.verbs.options.CompressOptions`; memory choices come from
:mod:`layerwise.runtime.memory_policy`, sizes and writing from the chosen
:class:`~layerwise.host.saver.Saver`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from layerwise.algorithms.quantization.storage import keeping_codes
from layerwise.common.quiet import library_bars_follow_show_progress
from layerwise.errors import DatasetError, InvalidArgumentError
from layerwise.host.lifecycle import Lifecycle
from layerwise.host.patch_selection import use_patch
from layerwise.host.pipeline import PipelineOptions
from layerwise.host.pipeline_selection import check_requested_pipeline
from layerwise.host.plugin_manager import registry
from layerwise.host.recipe import RecipeLike, parse_recipe, recipe_to_yaml
from layerwise.host.saver import Saver
from layerwise.host.state import CompressionState
from layerwise.host.versions import warn_if_untested
from layerwise.model_io.calibration_data import (
    batches_from_records,
    check_unread_dataset,
    default_max_seq_length,
    describe_data,
    load_records,
    warn_about_calibration,
)
from layerwise.model_io.compressed_loading import quantization_config
from layerwise.model_io.loading import load_model, load_tokenizer
from layerwise.model_io.model_paths import (
    AlreadyQuantizedError,
    check_model_path,
    check_not_quantized,
    describe_quantization,
)
from layerwise.model_io.saving import (
    Overwrite,
    check_not_an_input,
    check_output_dir,
    output_target,
    reserve_output,
    run_inputs,
    write_failures_named,
)
from layerwise.model_io.streaming.stream import (
    StreamingError,
    choose_streaming,
    seal_streamed_model,
)
from layerwise.reports.run_report import CompressionReport
from layerwise.runtime import distributed
from layerwise.runtime.accounting import Accounting
from layerwise.runtime.devices import out_of_memory_error, resolve_device
from layerwise.runtime.finite import check_weights
from layerwise.runtime.memory_policy import choose_offload
from layerwise.runtime.sizes import parameter_bytes
from layerwise.tracing.targets import check_entries, choose_targets
from layerwise.verbs.options import CompressOptions, setting_names, with_everyday

F = TypeVar("F", bound=Callable[..., Any])


class FlatOptionWarning(DeprecationWarning):
    """A run setting passed to ``compress()`` as a flat keyword, the spelling of releases before the options."""


def _accept_flat_settings(function: F) -> F:
    """``compress(model, recipe, pieces="layers")``, as written before :class:`CompressOptions`, still runs
    for this release series, with a warning that gives the spelling that lasts."""
    own = set(inspect.signature(function).parameters)
    moved = set(setting_names()) - own

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        settings = {name: kwargs.pop(name) for name in list(kwargs) if name in moved}
        if settings:
            spelled = ", ".join(f"{name}=..." for name in settings)
            warnings.warn(f"compress({spelled}): run settings go in options=CompressOptions.of({spelled}) "
                          f"(from layerwise import CompressOptions); the flat keywords will stop working in 0.2",
                          FlatOptionWarning, stacklevel=2)
            kwargs["options"] = (kwargs.get("options") or CompressOptions()).replace(**settings)
        return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@_accept_flat_settings
@library_bars_follow_show_progress
@distributed.guarded  # several ranks: one failing stops them all; they return once rank 0 saved
def compress(
    model: torch.nn.Module | str | os.PathLike,
    recipe: RecipeLike = "W4A16",
    dataset: Any = None,
    *,
    output_dir: str | os.PathLike | None = None,
    num_calibration_samples: int | None = None,
    max_seq_length: int | None = None,
    device: str | torch.device | None = None,
    overwrite: Overwrite | None = None,
    show_progress: bool = True,
    options: CompressOptions | None = None,
) -> torch.nn.Module:
    """Compress ``model`` with ``recipe``, calibrating on ``dataset``; returns the model.

    ``model`` is a folder, a hub id or an ``nn.Module`` (compressed in place). ``recipe`` is a
    preset name, YAML text or file, a dict, or Modifier objects. ``dataset`` is texts, a
    ``.txt`` / ``.jsonl`` file, a ``datasets.Dataset`` or tokenized samples.

    With ``output_dir`` the result is written there atomically in ``options.output.save_format``;
    an output folder that is, holds or lies inside the model's folder, or holds the dataset or
    recipe file, is refused. An existing non-empty one is replaced with ``overwrite=True`` only
    when layerwise wrote it (it holds ``layerwise_summary.json``); ``overwrite="any"`` replaces
    any folder. ``num_calibration_samples`` (512) and ``max_seq_length`` (2048, or the model's
    context length when shorter) size the calibration data. ``device`` is where calibration runs:
    ``"cpu"``, ``"cuda"``, ``"cuda:N"``, or ``None`` for the first GPU torch sees (else the CPU);
    weights rest where they were loaded and each piece is onloaded there; running out of memory
    there is a named error listing the fixes that apply.

    With ``options.placement.weights="model-free"`` no model is built: a data-free recipe quantizes the
    folder's safetensors shard by shard (:mod:`layerwise.model_io.model_free`) and the run's
    :class:`~layerwise.reports.run_report.CompressionReport` is returned instead of a model.

    Every other setting is in ``options`` (:class:`~layerwise.verbs.options.CompressOptions`:
    calibration, placement, output and safety groups, each field documented there); the everyday
    arguments above, when given, override their fields. The run's summary is
    ``model.layerwise_report``. A run whose weights streamed from disk returns a model without them:
    calling it raises, naming the output folder to load instead.
    """
    start = time.perf_counter()
    options = with_everyday(options or CompressOptions(), num_calibration_samples, max_seq_length, device, overwrite)
    calibration, placement, output, safety = options.calibration, options.placement, options.output, options.safety
    if placement.weights == "model-free":  # no model at all: the report is what there is to return
        return _model_free(model, recipe, output_dir, options)
    execution_device = resolve_device(placement.device)
    if not isinstance(model, torch.nn.Module):
        check_model_path(model)  # a mistyped folder fails in a moment, before plugins load
        check_not_quantized(model)
    elif getattr(getattr(model, "config", None), "quantization_config", None):
        raise AlreadyQuantizedError(f"the model passed is already quantized "
                                    f"({describe_quantization(quantization_config(model.config))}): "
                                    f"compress the original, unquantized model instead")
    if output.resume:
        _check_resumable(model, placement.weights, output_dir)
    streamed, weights_note = choose_streaming(model, "stream" if output.resume else placement.weights)
    warn_if_untested()
    if output_dir is not None and distributed.is_main():  # refuse an existing folder before an hour of calibration
        check_not_an_input(output_dir, run_inputs(model, dataset, recipe))
        check_output_dir(output_dir, output.overwrite)
    # what the user typed is checked before the model loads: a typo costs a second, not minutes
    modifiers = parse_recipe(recipe)
    saver: Saver = registry("savers").get(output.save_format)  # an unknown name lists the registered ones
    check_requested_pipeline(calibration.pipeline, modifiers)
    needs_data = any(m.requires_data for m in modifiers)
    if needs_data and dataset is None:
        names = ", ".join(type(m).__name__ for m in modifiers if m.requires_data)
        raise DatasetError(f"{names} needs calibration data: pass dataset= (CLI: --dataset; texts, a .txt/.jsonl "
                           f"file, a datasets.Dataset or tokenized samples)")
    records = load_records(dataset) if needs_data else []
    if dataset is not None and not needs_data:
        check_unread_dataset(dataset, modifiers)
    if streamed and output_dir is not None and not saver.streams:
        raise StreamingError(f"save format {output.save_format!r} cannot write a run whose weights stream from "
                             f"disk (its saver does not stream); use save_format='compressed-tensors' or "
                             f"weights='memory'")
    writes = output_dir is not None and distributed.is_main()
    before = Accounting()  # the phases before the run's state exists, added to its accounting then
    if distributed.is_main():  # what `layerwise plan` says will fail never starts, the disk it needs included
        from layerwise.verbs.plan import preflight

        with before.timed("plan checks"):
            preflight(model, recipe, dataset, options, output_dir if writes else None)
    # the saver encodes the codes quantizing computed (kept only while there is an output to write)
    with _claim(output_dir if writes else None, output.overwrite, output.resume) as claimed, keeping_codes(writes):
        source, stream = None, None
        tokenizer = calibration.tokenizer
        if not isinstance(model, torch.nn.Module):
            source = str(model)
            if streamed:
                from layerwise.model_io.streaming import build_streamed_model

                model, stream = build_streamed_model(source, patch=calibration.patch,
                                                     trust_remote_code=safety.trust_remote_code)
                # every rank encodes what it finishes (the sizes are reported), rank 0 alone writes
                stream.write_to(claimed if writes else None, saver.encode_module if output_dir is not None else None)
            else:
                with before.timed("load"):
                    model = load_model(source, patch=calibration.patch, trust_remote_code=safety.trust_remote_code)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source, safety.trust_remote_code)
        chosen_patch = use_patch(model, calibration.patch)
        warn_if_untested(chosen_patch)
        model.eval()
        # a NaN weight fails in seconds, not after calibration (streamed: read one tensor at a time)
        with before.timed("weight check"):
            skipped = check_weights(model, safety.non_finite, bad=stream.non_finite() if stream is not None else None)
        if stream is not None:
            stream.exempt = tuple(f"{name}." for name in skipped)

        # what the user wrote is checked before any calibration: a typo is an error, never a fallback
        named_targets = list(calibration.sequential_targets) if calibration.sequential_targets is not None else None
        choice = choose_targets(model, named_targets, chosen_patch)
        if calibration.ignore is not None:
            check_entries(model, list(calibration.ignore), "ignore entry")
        targets, targets_found = list(choice.targets), choice.describe(model)
        ignore = (list(calibration.ignore) if calibration.ignore is not None
                  else list(chosen_patch.ignore if chosen_patch else []))
        seq_length = calibration.max_seq_length or default_max_seq_length(model)
        batches = (batches_from_records(records, tokenizer, calibration.num_calibration_samples, seq_length,
                                        calibration.packing, source=dataset,
                                        chat_template=calibration.chat_template) if needs_data else [])
        calibration_samples = len(batches)
        if needs_data:
            minimum = max(((type(m).__name__, m.min_calibration_samples) for m in modifiers if m.requires_data),
                          key=lambda pair: pair[1])
            warn_about_calibration(model, calibration.max_seq_length, calibration_samples,
                                   minimum if minimum[1] else None)
        batches = distributed.shard(batches)  # several ranks: each calibrates on its share

        offload, offload_note = choose_offload(placement.offload, model, batches)
        bytes_before = parameter_bytes(model)
        state = CompressionState(model=model, modifiers=modifiers, patch=chosen_patch,
                                 sequential_targets=targets, ignore=[*ignore, *skipped],
                                 execution_device=execution_device, batches=batches)
        state.accounting.update(before)
        fingerprint = {**options.fingerprint(), "targets": targets, "ignore": ignore, "max_seq_length": seq_length}
        pipeline_options = PipelineOptions(
            sequential_targets=targets, ignore=ignore, propagate_error=calibration.propagate_error,
            pieces=calibration.pieces, offload=offload, execution_device=state.execution_device,
            targets_per_subgraph=calibration.targets_per_subgraph, show_progress=show_progress, stream=stream,
            checkpoint=_piece_checkpoint(claimed, stream, source, recipe_to_yaml(modifiers), batches, fingerprint,
                                         output.resume))
        lifecycle = Lifecycle(state)
        from layerwise.host.pipeline_selection import recording_fallbacks, run_pipeline

        try:
            lifecycle.initialize()
            # targets the user named are never dropped for the whole model at once: no fallback to basic
            exclude = ("basic",) if named_targets else ()
            if stream is not None:
                exclude = _pipelines_not_streaming(calibration.pipeline)
            with recording_fallbacks() as fallbacks:
                pipeline_used = run_pipeline(model, batches, lifecycle, pipeline_options,
                                             requested=calibration.pipeline, exclude=exclude)
        except BaseException as exc:
            lifecycle.remove_hooks()  # no modifier hook outlives a failed run
            if stream is not None:
                stream.close()
            if isinstance(exc, torch.OutOfMemoryError):
                raise out_of_memory_error(exc, execution_device, offload, calibration.targets_per_subgraph,
                                          stream is not None) from exc
            raise
        with state.accounting.timed("finalize"):
            lifecycle.finalize()

        from layerwise.algorithms.quantization.storage import quantized_modules
        from layerwise.algorithms.sparsity.storage import sparse_modules

        compressed = list({**quantized_modules(model), **sparse_modules(model)})
        checkpoint = pipeline_options.checkpoint
        if checkpoint is not None and checkpoint.resumed_from is not None:
            # the phases are this process's: the interrupted run's time is named as one, not left in "other"
            state.accounting.add("before the resume", checkpoint.earlier_seconds)
        report = CompressionReport(
            pipeline=pipeline_used, modifiers=[type(m).__name__ for m in modifiers],
            compressed_modules=compressed, seconds=0.0, bytes_before=bytes_before,
            bytes_after=saver.saved_bytes(model) if stream is None else stream.output_bytes(bytes_before),
            calibration_samples=calibration_samples, layer_log=state.log,
            targets_found=targets_found, targets_source=choice.source,
            model=source or type(model).__name__, architecture=type(model).__name__, ranks=distributed.world_size(),
            recipe=recipe_to_yaml(modifiers),
            sequential_targets=targets,
            fallbacks=fallbacks, guards_retraced=list(state.guards_retraced), skipped_non_finite=skipped,
            pieces=state.pieces, accounting=state.accounting.as_dict(), placement=state.placement,
            cache_peak_bytes=state.cache_peak,
            calibration_data=describe_data(dataset) if needs_data else {},
            weights=f"stream ({weights_note})" if stream is not None else "memory",
            activations=offload_note, options=options.as_dict(),
        )
        _record_peaks(report)
        if checkpoint is not None and checkpoint.resumed_from is not None:
            report.resumed_from_piece = checkpoint.resumed_from + 1
            report.resumed_after_last_piece = checkpoint.resumed_from == checkpoint.pieces
            start -= checkpoint.earlier_seconds  # the report's time is the whole run's, interruptions aside
        if writes:  # several ranks: rank 0 writes
            with state.accounting.timed("save"):
                _save(saver, model, stream, output_dir, tokenizer, report, modifiers, output.overwrite, start)
            report.accounting = state.accounting.as_dict()  # the saved summary's stops before saving
        if stream is not None:
            stream.close()
            seal_streamed_model(model, output_dir if writes else None)
        report.seconds = time.perf_counter() - start
        model.layerwise_report = report  # type: ignore[attr-defined]
        return model


def _model_free(model: Any, recipe: RecipeLike, output_dir: Any, options: CompressOptions) -> Any:
    """``weights="model-free"``: :func:`~layerwise.model_io.model_free.compress_model_free`; returns its report."""
    from layerwise.model_io.model_free import compress_model_free
    from layerwise.model_io.model_free.run import refuse_sequential_targets

    refuse_sequential_targets(options.calibration.sequential_targets)
    if isinstance(model, torch.nn.Module) or output_dir is None:
        raise InvalidArgumentError("weights='model-free' reads a model folder's safetensors and writes an output "
                                   "folder: pass the folder and output_dir= (CLI: --model FOLDER --output-dir OUT)")
    return compress_model_free(model, recipe, output_dir, ignore=options.calibration.ignore,
                               overwrite=options.output.overwrite, workers=options.placement.workers,
                               save_format=options.output.save_format, patch=options.calibration.patch)


def _save(saver: Saver, model: torch.nn.Module, stream: Any, output_dir: str | os.PathLike, tokenizer: Any,
          report: CompressionReport, modifiers: list, overwrite: Overwrite, start: float) -> None:
    """Write the output folder with the run summary and the modifiers' own files beside the weights."""
    from layerwise.reports.run_summary import SUMMARY_FILE, summary_json

    report.output_dir = str(Path(output_dir))
    report.seconds = time.perf_counter() - start  # the saved summary counts up to saving
    from layerwise.reports.model_card import output_card_files

    extra = {SUMMARY_FILE: summary_json(report), **output_card_files(report, output_dir)}
    for modifier in modifiers:
        extra.update(modifier.output_files())
    if stream is not None:
        saver.save_streamed(model, stream, output_dir, tokenizer=tokenizer, recipe=report.recipe,
                            extra_files=extra, overwrite=overwrite)
    else:
        saver.save(model, output_dir, tokenizer=tokenizer, recipe=report.recipe, extra_files=extra,
                   overwrite=overwrite)


def _pipelines_not_streaming(requested: str | None) -> tuple[str, ...]:
    """The pipelines that cannot run with weights on disk; one asked for by name is an error."""
    pipelines = registry("pipelines")
    cannot = tuple(n for n in pipelines.names() if not getattr(pipelines.get(n), "streams_weights", False))
    if requested in cannot:
        raise StreamingError(f"pipeline {requested!r} needs every weight in memory; with weights streamed from disk "
                             f"use one that runs piece by piece "
                             f"({', '.join(n for n in pipelines.names() if n not in cannot)}) or weights='memory'")
    return cannot


def _record_peaks(report: CompressionReport) -> None:
    """The process's peak RSS (and the GPU's peak allocation) into ``report``."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report.peak_rss_bytes = peak if sys.platform == "darwin" else peak * 1024
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        report.peak_gpu_bytes = torch.cuda.max_memory_allocated()


@contextlib.contextmanager
def _claim(output_dir: str | os.PathLike | None, overwrite: bool, resume: bool = False) -> Iterator[Path | None]:
    """The output claimed (locked) for the run, before the model loads; nothing without one. A write there the
    operating system refuses during the run (a streamed piece, a resume checkpoint: a full disk) is an
    :class:`~layerwise.model_io.saving.OutputNotWritableError` naming the output folder, not a bare OSError."""
    if output_dir is None:
        yield None
        return
    with write_failures_named(output_target(output_dir), named_only=True), \
            reserve_output(output_dir, overwrite, resume) as claimed:
        yield claimed


def _check_resumable(model: Any, weights: str, output_dir: Any) -> None:
    """``resume=True`` needs a model folder, an output folder, and weights streamed from disk."""

    if output_dir is None:
        raise InvalidArgumentError("resume=True continues writing an output folder: pass output_dir= "
                                   "(CLI: --output-dir), the one the interrupted run was writing")
    if isinstance(model, torch.nn.Module) or weights == "memory":
        raise InvalidArgumentError("resume=True needs the weights streamed from the model's folder (a checkpoint "
                                   "is the pieces written so far): pass the folder, and weights='stream' or 'auto'")
    if distributed.world_size() > 1:
        raise InvalidArgumentError("resume=True is for one process: a data-parallel run's ranks each cache their own "
                                   "share of the activations, which the checkpoint does not hold; run without resume")


def _piece_checkpoint(claimed: Any, stream: Any, source: str, recipe: str, batches: list, options: dict,
                      resume: bool) -> Any:
    """The resume checkpoint of a streamed run that writes an output, else ``None``."""
    if stream is None or stream.writer is None:
        return None
    from layerwise.model_io.resume import PieceCheckpoint, fingerprint

    checkpoint = PieceCheckpoint(Path(claimed), fingerprint(source, recipe, batches, options), resume)
    stream.on_finish.append(checkpoint.discard)
    return checkpoint
