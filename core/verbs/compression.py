"""``compress()``: the one verb. Load, pick the patch, parse the recipe, calibrate, save."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from layerwise.algorithms.quantization.storage import linear_weight
from layerwise.algorithms.sparsity.bitmask import BITMASK, SPARSE_24, encoded_bytes
from layerwise.algorithms.sparsity.masks import MaskStructure
from layerwise.algorithms.sparsity.storage import SPARSITY_ATTR
from layerwise.errors import DatasetError, check_choice, require_positive
from layerwise.host.lifecycle import Lifecycle
from layerwise.host.model_patch import ModelPatch
from layerwise.host.patch_selection import use_patch
from layerwise.host.pipeline import PipelineOptions, check_pieces
from layerwise.host.plugin_manager import registry
from layerwise.host.recipe import RecipeLike, parse_recipe, recipe_to_yaml
from layerwise.host.state import CompressionState
from layerwise.host.versions import warn_if_untested
from layerwise.model_io.calibration_data import batches_from_records, load_records
from layerwise.model_io.loading import load_model, load_tokenizer
from layerwise.model_io.model_paths import check_model_path
from layerwise.model_io.saving import (
    Overwrite,
    check_not_an_input,
    check_output_dir,
    reserve_output,
    run_inputs,
)
from layerwise.model_io.streaming.stream import WEIGHTS
from layerwise.reports.run_report import CompressionReport
from layerwise.runtime import distributed
from layerwise.runtime.devices import out_of_memory_error, resolve_device
from layerwise.runtime.finite import check_mode, check_weights
from layerwise.tracing.targets import check_entries, choose_targets

log = logging.getLogger("layerwise")


#: tokens per calibration sample unless the model's context is shorter
DEFAULT_MAX_SEQ_LENGTH = 2048
#: config fields that hold a model's context length, by family
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def default_max_seq_length(model: torch.nn.Module) -> int:
    """2048, or the model's context length when shorter.

    Calibration windows longer than the context would run positions the model never
    learned (and an absolute position table would be indexed out of range).
    """
    config = getattr(model, "config", None)
    for part in (config, getattr(config, "text_config", None)):
        for name in _CONTEXT_FIELDS:
            value = getattr(part, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return min(DEFAULT_MAX_SEQ_LENGTH, value)
    return DEFAULT_MAX_SEQ_LENGTH


@distributed.guarded  # several ranks: one failing stops them all; they return once rank 0 saved
def compress(
    model: torch.nn.Module | str | os.PathLike,
    recipe: RecipeLike = "W4A16",
    dataset: Any = None,
    num_calibration_samples: int = 512,
    max_seq_length: int | None = None,
    sequential_targets: list[str] | None = None,
    ignore: list[str] | None = None,
    output_dir: str | os.PathLike | None = None,
    *,
    pipeline: str | None = None,
    patch: ModelPatch | str | bool | None = None,
    tokenizer: Any = None,
    packing: str | None = None,
    propagate_error: bool = True,
    pieces: str = "auto",
    offload: str = "auto",
    targets_per_subgraph: int = 1,
    overwrite: Overwrite = False,
    save_format: str = "compressed-tensors",
    show_progress: bool = True,
    non_finite: str = "error",
    trust_remote_code: bool = False,
    weights: str = "auto",
    resume: bool = False,
    device: str | torch.device | None = None,
) -> torch.nn.Module:
    """Compress ``model`` with ``recipe``, calibrating on ``dataset``; returns the model.

    ``model`` is a folder, a hub id or an ``nn.Module`` (compressed in place). With
    ``output_dir`` the result is written there atomically in ``save_format``; an output folder
    that is, holds or lies inside the model's folder, or holds the dataset or recipe file, is
    refused. An existing non-empty one is replaced with ``overwrite=True`` only when layerwise
    wrote it (it holds ``layerwise_summary.json``); ``overwrite="any"`` replaces any folder.
    ``max_seq_length`` (tokens per calibration sample) defaults to 2048, or to the
    model's context length when that is shorter.
    The run's summary is ``model.layerwise_report``.
    ``pieces`` says where the ``sequential`` pipeline cuts the model: ``"layers"`` before each
    group of layers a modifier reads (their statistics come from cached inputs and every piece
    runs once per sample: "true sequential"), ``"blocks"`` after each sequential target (each
    block runs twice, once observed and once compressed), ``"auto"`` layers where the model
    traces that finely and every modifier only reads layer inputs, else blocks.
    A parameter holding NaN or inf is an error before calibration; ``non_finite="skip"``
    leaves the modules holding one uncompressed instead (listed in the report).
    ``trust_remote_code=True`` lets transformers run Python shipped with a model folder or
    hub repo (its ``auto_map``); off, such a model is refused with the code it would run named.
    ``offload`` says where cached activations rest between pieces: ``"cpu"``, ``"disk"``, or
    ``"auto"``: disk when the estimated cache would take more than half the memory available.
    ``weights`` says where the weights rest:
    ``"memory"`` loads the model whole; ``"stream"`` leaves them on disk, reads each piece's
    tensors when it runs and writes its compressed tensors to the output as soon as it is done
    (a folder of safetensors; peak memory about one piece); ``"auto"`` streams when loading the
    model whole would not fit in the memory available.
    ``device`` is where calibration runs: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, or ``None`` for
    the first GPU torch sees (else the CPU); weights rest where they were loaded and each piece is
    onloaded there. Running out of memory there is a named error listing the fixes that apply.
    ``resume=True`` continues a run on the same ``output_dir`` that was interrupted (killed,
    out of memory, Ctrl-C) after its last finished piece; it needs the streamed path (a model
    folder), which saves a checkpoint after every piece. Without it, such a checkpoint is an
    error that names it (never reused or deleted silently).
    """
    start = time.perf_counter()
    _check_counts(num_calibration_samples, max_seq_length, targets_per_subgraph)
    check_pieces(pieces)
    check_mode(non_finite)
    check_choice(weights, WEIGHTS, "weights", "--weights")
    check_choice(offload, OFFLOADS, "offload", "--offload")
    execution_device = resolve_device(device)
    if not isinstance(model, torch.nn.Module):
        check_model_path(model)  # a mistyped folder fails in a moment, before plugins load
    if resume:
        _check_resumable(model, weights, output_dir)
        weights = "stream"
    streamed, weights_note = _streamed(model, weights)
    warn_if_untested()
    if output_dir is not None and distributed.is_main():  # refuse an existing folder before an hour of calibration
        check_not_an_input(output_dir, run_inputs(model, dataset, recipe))
        check_output_dir(output_dir, overwrite)
    # what the user typed is checked before the model loads: a typo costs a second, not minutes
    modifiers = parse_recipe(recipe)
    saver = registry("savers").get(save_format) if output_dir is not None else None
    if pipeline is not None:
        registry("pipelines").get(pipeline)  # an unknown name lists the registered ones
    needs_data = any(m.requires_data for m in modifiers)
    if needs_data and dataset is None:
        names = ", ".join(type(m).__name__ for m in modifiers if m.requires_data)
        raise DatasetError(f"{names} needs calibration data: pass dataset= (texts, a .txt/.jsonl file, "
                           f"a datasets.Dataset or tokenized samples)")
    records = load_records(dataset) if needs_data else []
    if streamed and saver is not None:
        _check_streamable_saver(saver, save_format)
    writes = saver is not None and distributed.is_main()
    with _claim(output_dir if writes else None, overwrite, resume) as claimed:  # a second run on it fails now
        source, stream = None, None
        if not isinstance(model, torch.nn.Module):
            source = str(model)
            if streamed:
                from layerwise.model_io.streaming import build_streamed_model

                model, stream = build_streamed_model(source, patch=patch, trust_remote_code=trust_remote_code)
                # every rank encodes what it finishes (the sizes are reported), rank 0 alone writes
                stream.write_to(claimed if writes else None, saver.encode_module if saver is not None else None)
            else:
                model = load_model(source, patch=patch, trust_remote_code=trust_remote_code)
            tokenizer = tokenizer if tokenizer is not None else load_tokenizer(source, trust_remote_code)
        chosen_patch = use_patch(model, patch)
        warn_if_untested(chosen_patch)
        model.eval()
        # a NaN weight fails in seconds, not after calibration (streamed: read one tensor at a time)
        skipped = check_weights(model, non_finite, bad=stream.non_finite() if stream is not None else None)
        if stream is not None:
            stream.exempt = tuple(f"{name}." for name in skipped)

        # what the user wrote is checked before any calibration: a typo is an error, never a fallback
        choice = choose_targets(model, sequential_targets, chosen_patch)
        if ignore is not None:
            check_entries(model, ignore, "ignore entry")
        targets, targets_found = list(choice.targets), choice.describe(model)
        ignore = list(ignore) if ignore is not None else list(chosen_patch.ignore if chosen_patch else [])
        if max_seq_length is None:
            max_seq_length = default_max_seq_length(model)
        batches = (batches_from_records(records, tokenizer, num_calibration_samples, max_seq_length, packing,
                                        source=dataset) if needs_data else [])
        calibration_samples = len(batches)
        batches = distributed.shard(batches)  # several ranks: each calibrates on its share

        offload, offload_note = _cache_offload(offload, model, batches)
        bytes_before = _parameter_bytes(model)
        state = CompressionState(model=model, modifiers=modifiers, patch=chosen_patch,
                                 sequential_targets=targets, ignore=[*ignore, *skipped],
                                 execution_device=execution_device, batches=batches)
        options = PipelineOptions(sequential_targets=targets, ignore=ignore, propagate_error=propagate_error,
                                  pieces=pieces, offload=offload, execution_device=state.execution_device,
                                  targets_per_subgraph=targets_per_subgraph, show_progress=show_progress,
                                  stream=stream,
                                  checkpoint=_piece_checkpoint(
                                      claimed, stream, source, recipe_to_yaml(modifiers), batches,
                                      {"targets": targets, "ignore": ignore, "pieces": pieces,
                                       "propagate_error": propagate_error, "max_seq_length": max_seq_length,
                                       "targets_per_subgraph": targets_per_subgraph, "save_format": save_format,
                                       "non_finite": non_finite}, resume))
        lifecycle = Lifecycle(state)
        from layerwise.host.pipeline_selection import recording_fallbacks, run_pipeline

        try:
            lifecycle.initialize()
            # targets the user named are never dropped for the whole model at once: no fallback to basic
            exclude = ("basic",) if sequential_targets else ()
            if stream is not None:
                exclude = _pipelines_not_streaming(pipeline)
            with recording_fallbacks() as fallbacks:
                pipeline_used = run_pipeline(model, batches, lifecycle, options, requested=pipeline,
                                             exclude=exclude)
        except BaseException as exc:
            lifecycle.remove_hooks()  # no modifier hook outlives a failed run
            if stream is not None:
                stream.close()
            if isinstance(exc, torch.OutOfMemoryError):
                raise out_of_memory_error(exc, execution_device, offload, targets_per_subgraph,
                                          stream is not None) from exc
            raise
        lifecycle.finalize()

        from layerwise.algorithms.quantization.storage import quantized_modules
        from layerwise.algorithms.sparsity.storage import sparse_modules

        compressed = list({**quantized_modules(model), **sparse_modules(model)})
        report = CompressionReport(
            pipeline=pipeline_used, modifiers=[type(m).__name__ for m in modifiers],
            compressed_modules=compressed, seconds=0.0, bytes_before=bytes_before,
            bytes_after=_compressed_bytes(model) if stream is None else _streamed_bytes(stream, bytes_before),
            calibration_samples=calibration_samples, layer_log=state.log,
            targets_found=targets_found, targets_source=choice.source,
            model=source or type(model).__name__, recipe=recipe_to_yaml(modifiers), sequential_targets=targets,
            fallbacks=fallbacks, guards_retraced=list(state.guards_retraced), skipped_non_finite=skipped,
            pieces=state.pieces, accounting=state.accounting.as_dict(),
            weights=f"stream ({weights_note})" if stream is not None else "memory",
            activations=offload_note,
        )
        _record_peaks(report)
        if saver is not None and distributed.is_main():  # several ranks: rank 0 writes
            from layerwise.reports.run_summary import SUMMARY_FILE, summary_json

            report.output_dir = str(Path(output_dir))
            report.seconds = time.perf_counter() - start  # the saved summary counts up to saving
            extra = {SUMMARY_FILE: summary_json(report)}
            for modifier in modifiers:
                extra.update(modifier.output_files())
            if stream is not None:
                saver.save_streamed(model, stream, output_dir, tokenizer=tokenizer, recipe=report.recipe,
                                    extra_files=extra, overwrite=overwrite)
            else:
                saver(model, output_dir, tokenizer=tokenizer, recipe=report.recipe,
                      extra_files=extra, overwrite=overwrite)
        if stream is not None:
            stream.close()
        report.seconds = time.perf_counter() - start
        model.layerwise_report = report  # type: ignore[attr-defined]
        return model


def _streamed(model: Any, weights: str) -> tuple[bool, str]:
    """Whether this run streams its weights from disk, and why (``weights`` checked, a folder given)."""
    from layerwise.model_io.streaming.stream import StreamingError, should_stream

    if weights == "memory":
        return False, ""
    if isinstance(model, torch.nn.Module):
        if weights == "stream":
            raise StreamingError("weights='stream' reads the model from its folder, but a loaded module was passed: "
                                 "pass the folder instead (or weights='memory')")
        return False, ""
    if weights == "stream":
        return True, "asked for"
    stream, why = should_stream(model)
    if stream:
        log.info("layerwise: the model would not fit in memory (%s): streaming its weights from disk", why)
    return stream, f"would not fit in memory: {why}"


#: share of the available memory the activation cache may take before ``offload="auto"`` puts it on disk
CACHE_MEMORY_SHARE = 0.5
OFFLOADS = ("auto", "cpu", "disk")


def _cache_offload(offload: str, model: torch.nn.Module, batches: list[dict[str, Any]]) -> tuple[str, str]:
    """Where cached activations rest, and the note the report gives: ``auto`` becomes disk when the cache
    at a cut (about three hidden-state-sized values per token) would not fit in half the available memory."""
    if offload != "auto":
        return offload, offload
    from layerwise.model_io.streaming.stream import available_memory

    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(getattr(config, "text_config", None), "hidden_size", 0)
    tokens = sum(int(v.numel()) for batch in batches for k, v in batch.items()
                 if k == "input_ids" and isinstance(v, torch.Tensor))
    element = next((p.element_size() for p in model.parameters() if p.is_floating_point()), 4)
    estimate = 3 * tokens * int(hidden or 0) * element
    free = available_memory()
    if free is not None and estimate > CACHE_MEMORY_SHARE * free:
        note = (f"disk (auto: ~{estimate / 2**30:.1f} GiB of activations, {free / 2**30:.1f} GiB memory available)")
        log.info("layerwise: cached activations go to disk: %s", note)
        return "disk", note
    return "cpu", "cpu"


def _check_streamable_saver(saver: Any, save_format: str) -> None:
    from layerwise.model_io.streaming.stream import StreamingError

    if not (callable(getattr(saver, "encode_module", None)) and callable(getattr(saver, "save_streamed", None))):
        raise StreamingError(f"save format {save_format!r} cannot write a run whose weights stream from disk (its "
                             f"saver has no encode_module / save_streamed); use save_format='compressed-tensors' "
                             f"or weights='memory'")


def _pipelines_not_streaming(requested: str | None) -> tuple[str, ...]:
    """The pipelines that cannot run with weights on disk; one asked for by name is an error."""
    from layerwise.model_io.streaming.stream import StreamingError

    pipelines = registry("pipelines")
    cannot = tuple(n for n in pipelines.names() if not getattr(pipelines.get(n), "streams_weights", False))
    if requested in cannot:
        raise StreamingError(f"pipeline {requested!r} needs every weight in memory; with weights streamed from disk "
                             f"use one that runs piece by piece "
                             f"({', '.join(n for n in pipelines.names() if n not in cannot)}) or weights='memory'")
    return cannot


def _streamed_bytes(stream: Any, bytes_before: int) -> int:
    """What a streamed run's tensors take on disk (the finished modules', plus the rest still to copy as is)."""
    return stream.final_bytes + max(bytes_before - stream.covered_bytes(), 0)


def _record_peaks(report: CompressionReport) -> None:
    """The process's peak RSS (and the GPU's peak allocation) into ``report``."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    report.peak_rss_bytes = peak if sys.platform == "darwin" else peak * 1024
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        report.peak_gpu_bytes = torch.cuda.max_memory_allocated()


def _claim(output_dir: str | os.PathLike | None, overwrite: bool, resume: bool = False
           ) -> contextlib.AbstractContextManager:
    """The output claimed (locked) for the run, before the model loads; nothing without one."""
    return reserve_output(output_dir, overwrite, resume) if output_dir is not None else contextlib.nullcontext()


def _check_resumable(model: Any, weights: str, output_dir: Any) -> None:
    """``resume=True`` needs a model folder, an output folder, and weights streamed from disk."""
    from layerwise.errors import InvalidArgumentError

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


def _check_counts(num_calibration_samples: int, max_seq_length: int | None, targets_per_subgraph: int) -> None:
    """Refuse a count below 1 before loading anything (0 tokens per sample used to end in ``range()``)."""
    require_positive(num_calibration_samples, "num_calibration_samples", "--num-samples")
    if max_seq_length is not None:
        require_positive(max_seq_length, "max_seq_length", "--max-seq-length")
    require_positive(targets_per_subgraph, "targets_per_subgraph", "--targets-per-subgraph")


def _parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters, each shared (tied) tensor counted once, as a save writes it."""
    seen: set[tuple] = set()
    return sum(p.numel() * p.element_size() for p in model.parameters() if _first_time(p, seen))


def _compressed_bytes(model: torch.nn.Module) -> int:
    """Bytes the weights take once saved: quantized weights at their bit width plus qparams, pruned ones
    (not quantized) in their bitmask layout.

    A tied tensor (an input embedding shared with the head) is counted once, as on disk.
    """
    total = 0
    seen: set[tuple] = set()
    for module in model.modules():
        args = getattr(module, "quantization_args", None)
        structure = getattr(module, SPARSITY_ATTR, None)
        for name, param in module.named_parameters(recurse=False):
            if not _first_time(param, seen):
                continue
            if name == "weight" and args is not None:
                total += param.numel() * args.num_bits // 8
            elif name == "weight" and structure is not None:  # pruned, not quantized: stored as a bitmask
                total += encoded_bytes(linear_weight(module).detach(), SPARSE_24 if structure == MaskStructure(2, 4)
                                       else BITMASK)
            else:
                total += param.numel() * param.element_size()
        if args is not None:
            for buffer_name in ("weight_scale", "weight_zero_point", "weight_g_idx"):
                buffer = getattr(module, buffer_name, None)
                if isinstance(buffer, torch.Tensor) and _first_time(buffer, seen):
                    total += buffer.numel() * buffer.element_size()
    return total


def _first_time(tensor: torch.Tensor, seen: set[tuple]) -> bool:
    """Whether ``tensor``'s bytes are new to ``seen`` (then recorded); the same view of one storage is not.

    A tensor without real storage (meta) is told apart by identity only.
    """
    from layerwise.runtime.placeholders import is_unloaded

    # a meta tensor, or a weight still on disk (placeholders share one element), is told apart by identity
    pointer = tensor.untyped_storage().data_ptr() if tensor.device.type != "meta" and not is_unloaded(tensor) else 0
    key = ((str(tensor.device), pointer, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
           if pointer else ("id", id(tensor)))
    if key in seen:
        return False
    seen.add(key)
    return True
