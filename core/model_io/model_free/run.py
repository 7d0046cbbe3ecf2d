"""``compress_model_free``: a data-free recipe applied to a safetensors folder without building the model.

1. Checked first, before any tensor is read: the folder (config.json, safetensors, not quantized
   already), the output folder (never an input, replaced only as ``overwrite`` allows), the recipe
   (data-free quantization modifiers only), every target and ignore entry against the tensor
   names (:mod:`.selection`, with did-you-mean errors), group sizes against the layers' widths,
   and memory: each worker holds one chunk of a layer's rows and its float32 work (the whole layer for
   per-tensor ranges), never its shard's output; the workers are as many as fit in the memory available
   (an error when not one does).
   MoE experts a checkpoint holds fused (3-D ``gate_up_proj`` / ``down_proj``) are split into per-expert
   2-D weights named as the in-memory run names its unfused layers, when the model patch declares the
   experts' names (``ModelPatch.expert_projections``, :mod:`.experts`); without it they stay dense, and
   the forecast and the report say so.
2. NVFP4 only: each layer's largest magnitude is read (a chunk at a time) for its global scale, shared by
   the projections vLLM fuses (q/k/v, gate/up: :mod:`~layerwise.algorithms.quantization.global_scales`, and
   the sets the model patch declares, each expert's gate and up among them, the patch matched from ``config.json``'s ``architectures`` or
   ``model_type`` as no model class is built: :func:`model_free_patch`), as the in-memory run shares it.
3. Each shard is quantized by one worker thread (:mod:`.worker`; torch's kernels and the file reads and
   writes release the GIL); each file is written header first, a chunk at a time, into the output's
   locked temporary folder, which becomes the output in one rename at the end
   (:func:`~layerwise.model_io.saving.atomic_output_dir`): complete or absent.
4. Beside the shards: the index, ``config.json`` with the saver's ``quantization_config``, every
   other file of the folder (tokenizer, generation config, ...) copied, ``recipe.yaml`` and
   ``layerwise_summary.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from layerwise.errors import LayerwiseError
from layerwise.host.model_patch import ModelPatch
from layerwise.host.recipe import RecipeLike, parse_recipe, recipe_to_yaml
from layerwise.host.saver import Saver
from layerwise.model_io.model_free.experts import (
    FusedExpertsError,
    check_experts_pairs,
    fused_experts_tensors,
    split_experts,
)
from layerwise.model_io.model_free.selection import (
    Layer,
    SelectionError,
    check_patterns,
    layers,
    select,
    warn_unmatched_ignore,
)
from layerwise.model_io.model_free.worker import (
    LayerJob,
    ShardJob,
    ShardResult,
    chunk_rows,
    default_threads,
    layer_amax,
    run_shard,
)
from layerwise.model_io.model_paths import check_model_path, check_not_quantized
from layerwise.model_io.saving import (
    Overwrite,
    atomic_output_dir,
    check_not_an_input,
    check_output_dir,
    run_inputs,
)
from layerwise.model_io.streaming.checkpoint import INDEX_FILE, SINGLE_FILE
from layerwise.model_io.streaming.safetensors_io import StoredTensor, read_header
from layerwise.runtime import memory_policy

#: float32 copies of a chunk of a layer's rows a worker's quantization holds at its peak (the observer's
#: input, the saver's, the rounding's and the packing's temporaries), beside the chunk as read
WORK_COPIES = 4
#: files of a model folder that are weights (never copied to the output as they are)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


class ModelFreeError(LayerwiseError, ValueError):
    """A model-free run that cannot go as asked (the message says why and what to do)."""


def compress_model_free(model: str | os.PathLike, recipe: RecipeLike, output_dir: str | os.PathLike, *,
                        ignore: Sequence[str] | None = None, overwrite: Overwrite = False, workers: int | None = None,
                        save_format: str = "compressed-tensors", patch: ModelPatch | str | bool | None = None) -> Any:
    """Quantize the safetensors folder ``model`` with the data-free ``recipe`` into ``output_dir``, shard by
    shard, without a model class; returns the run's :class:`~layerwise.reports.run_report.CompressionReport`.

    ``ignore`` adds module-name entries to every modifier's (default: the model patch's, as ``compress`` in
    memory: ``lm_head``, MoE routers, vision towers); ``workers`` (default: as many as there are
    shards, cores and memory for) is the number of shards quantized at once; ``patch`` is the model patch whose
    ``fused_projections`` NVFP4 shares global scales over and whose ``expert_projections`` split fused MoE
    experts (:func:`model_free_patch`; default: the one matching ``config.json``).
    """
    from layerwise.host.plugin_manager import registry

    start = time.perf_counter()
    check_model_path(str(model))
    check_not_quantized(str(model))
    folder = _folder(model)
    check_not_an_input(output_dir, run_inputs(str(folder), None, recipe))  # the recipe file too
    check_output_dir(output_dir, overwrite)
    chosen = model_free_patch(folder, patch)
    saver = registry("savers").get(save_format)
    if type(saver).quantization_config is Saver.quantization_config or not saver.streams:
        raise ModelFreeError(f"save format {save_format!r} cannot write a model-free run (its saver encodes no "
                             f"module on its own, or has no quantization_config); use save_format="
                             f"'compressed-tensors'")
    modifiers = parse_recipe(recipe)
    given, ignore = list(ignore or []), run_ignore(ignore, chosen)
    selection = _Selection.of(folder, modifiers, ignore, _expert_projections(chosen), given)
    shards, tensors, all_layers, plan, by_file = (selection.shards, selection.tensors, selection.layers,
                                                  selection.jobs, selection.by_file)
    workers = _workers(workers, shards, worker_memory(shards, by_file, all_layers))
    # the saver builds it as plain dicts (no compressed-tensors import: nothing to overlap with the shards' work)
    quantization_config = _quantization_config(saver, all_layers, plan, modifiers, ignore)
    plan = _with_global_scales(plan, all_layers, chosen)
    by_file = {file: [plan[job.module] for job in jobs] for file, jobs in by_file.items()}
    settings = {"weights": "model-free", "ignore": given or None, "patch": chosen.name if chosen else None,
                "workers": workers, "save_format": save_format, "overwrite": overwrite}
    report = _write(folder, output_dir, overwrite, shards, by_file, save_format, workers, quantization_config,
                    modifiers, plan, tensors, start, _expert_projections(chosen),
                    dense_experts_notes(selection.dense_experts), settings)
    report.seconds = time.perf_counter() - start
    return report


@dataclasses.dataclass(frozen=True)
class ModelFreeForecast:
    """What a model-free run of a folder will do and need, from the safetensors headers alone (``plan``)."""

    shards: int
    largest_shard: int
    source_bytes: int
    #: each layer quantized: its job (module, weight and input args), rows, columns and stored bytes
    jobs: tuple[tuple[LayerJob, int, int, int], ...]
    workers: int
    #: one worker's peak beside the process (:func:`worker_memory`)
    per_worker: int
    #: the model patch matched from ``config.json`` (:func:`model_free_patch`), by name
    patch: str | None = None
    #: fused MoE experts tensors left dense, as no patch declares how they split (:func:`dense_experts_notes`)
    dense_experts: tuple[str, ...] = ()


def forecast_model_free(model: str | os.PathLike, recipe: RecipeLike, *, ignore: Sequence[str] | None = None,
                        workers: int | None = None, patch: ModelPatch | str | bool | None = None) -> ModelFreeForecast:
    """The shards, layers, workers and memory a model-free run of ``model`` with ``recipe`` will have; the same
    selection (and the same errors) as :func:`compress_model_free`, no weight read, no model built."""
    folder = _folder(model)
    chosen = model_free_patch(folder, patch)
    selection = _Selection.of(folder, parse_recipe(recipe), run_ignore(ignore, chosen), _expert_projections(chosen),
                              list(ignore or []))
    sizes = {file: (folder / file).stat().st_size for file in selection.shards}
    shaped = tuple((job, selection.layers[job.module].rows, selection.layers[job.module].columns,
                    selection.layers[job.module].stored.nbytes) for job in selection.jobs.values())
    per_worker = worker_memory(selection.shards, selection.by_file, selection.layers)
    return ModelFreeForecast(len(selection.shards), max(sizes.values(), default=0), sum(sizes.values()), shaped,
                             _workers(workers, selection.shards, per_worker), per_worker,
                             chosen.name if chosen is not None else None, tuple(selection.dense_experts))


def dense_experts_notes(names: list[str] | tuple[str, ...]) -> list[str]:
    """What the forecast and the report say of fused experts left dense (nothing when there are none)."""
    if not names:
        return []
    shown = ", ".join(names[:2]) + (f", ... ({len(names)} tensors)" if len(names) > 2 else "")
    return [f"fused MoE experts stay dense: {shown} are 3-D tensors, and no model patch matched from config.json "
            f"declares how they split (ModelPatch.expert_projections); register a patch that does (or pass "
            f"patch=) to quantize them per expert"]


def refuse_sequential_targets(targets: Sequence[str] | None) -> None:
    """Sequential targets (``--targets``) say where a calibrated run cuts the model; a model-free run builds no
    model to cut, and taking them silently would let a user believe they chose the layers."""
    if targets:
        raise ModelFreeError(f"sequential targets {list(targets)} (--targets) cut a calibrated run into pieces; a "
                             f"model-free run builds no model and has none: choose its layers with the recipe's "
                             f"targets and ignore (patterns on module names, e.g. 're:.*mlp\\..*_proj'), or "
                             f"--ignore")


def run_ignore(ignore: Sequence[str] | None, patch: ModelPatch | None) -> list[str]:
    """``ignore`` as given, else the patch's ignore list: what ``compress`` in memory leaves out by default (a
    router quantized by a model-free run and not by vLLM's loader would make a checkpoint that does not load)."""
    if ignore is not None:
        return list(ignore)
    return list(patch.ignore) if patch is not None else []


def _expert_projections(patch: ModelPatch | None) -> tuple[str, ...]:
    return tuple(patch.expert_projections) if patch is not None else ()


def model_free_patch(folder: str | os.PathLike, patch: ModelPatch | str | bool | None = None) -> ModelPatch | None:
    """The model patch of a run that builds no model: ``None`` / ``True`` the registered one matching the folder's
    ``config.json`` (its ``architectures`` class names, then its ``model_type``:
    :func:`~layerwise.host.patch_selection.find_patch_for_config`), ``False`` none, a name or a
    :class:`ModelPatch` that one. Only its data serves (``fused_projections``, ``expert_projections``): nothing of
    it is applied."""
    from layerwise.host.patch_selection import chosen_patch

    return chosen_patch(patch, lambda: _config_patch(folder))


def _config_patch(folder: str | os.PathLike) -> ModelPatch | None:
    """The registered patch matching the folder's ``config.json`` (none without a readable one: the folder
    check says what is missing)."""
    from layerwise.host.patch_selection import find_patch_for_config

    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return find_patch_for_config(config) if isinstance(config, dict) else None


def _folder(model: str | os.PathLike) -> Path:
    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise ModelFreeError(f"{str(model)!r} is not a local folder: model-free compression reads the safetensors "
                             f"files of a folder; download it first")
    return folder


@dataclasses.dataclass(frozen=True)
class _Selection:
    """A folder's shards and tensors, its quantizable layers, the recipe's job for each, and the jobs by shard."""

    shards: list[str]
    tensors: dict[str, tuple[str, StoredTensor]]
    layers: dict[str, Layer]
    jobs: dict[str, LayerJob]
    by_file: dict[str, list[LayerJob]]
    #: fused MoE experts tensors left whole (no ``expert_projections`` to split them by)
    dense_experts: list[str] = dataclasses.field(default_factory=list)

    @staticmethod
    def of(folder: Path, modifiers: list, ignore: list[str] | None, projections: tuple[str, ...] = (),
           given_ignore: Sequence[str] = ()) -> _Selection:
        """``ignore``: the run's entries (the user's, else the patch's); ``given_ignore``: the user's, each of
        which must match a layer (a typo would quietly quantize the layer meant to stay dense)."""
        shards, tensors = _shards(folder, projections)
        all_layers = layers(tensors)
        try:
            check_patterns(given_ignore, list(all_layers), "compress", "ignore entry")
        except SelectionError as exc:
            raise ModelFreeError(str(exc)) from None
        jobs = _layer_jobs(modifiers, all_layers, list(ignore or []))
        by_file: dict[str, list[LayerJob]] = {file: [] for file in shards}
        for job in jobs.values():
            by_file[all_layers[job.module].file].append(job)
        return _Selection(shards, tensors, all_layers, jobs, by_file, fused_experts_tensors(tensors))


def _quantization_config(saver: Saver, all_layers: dict[str, Layer], plan: dict[str, LayerJob], modifiers: list,
                         ignore: list[str] | None) -> dict[str, Any]:
    """``config.json``'s ``quantization_config``, from the saver given the layers' args on a meta shadow model."""
    shadow = _shadow_model(all_layers, plan)
    return saver.quantization_config(shadow, {name: shadow.get_submodule(name) for name in plan},
                                     _ignore_entries(modifiers, ignore))


def _write(folder: Path, output_dir: str | os.PathLike, overwrite: Overwrite, shards: list[str],
           by_file: dict[str, list[LayerJob]], save_format: str, workers: int, quantization_config: dict[str, Any],
           modifiers: list, plan: dict[str, LayerJob], tensors: dict[str, tuple[str, StoredTensor]],
           start: float, projections: tuple[str, ...] = (), notes: list[str] | None = None,
           settings: dict[str, Any] | None = None) -> Any:
    """The output folder, complete or absent: the shards, their index, the config and the files beside;
    ``settings``: the run's settings as its summary records them (``options``)."""
    with atomic_output_dir(output_dir, overwrite=overwrite) as tmp:
        jobs = [ShardJob(folder / file, tmp / file, tuple(by_file[file]), save_format, default_threads(workers),
                         projections) for file in shards]
        results = _run(jobs, workers)
        weight_map = {name: result.file for result in results for name in result.names}
        total = sum(result.nbytes for result in results)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        _copy_other_files(folder, tmp)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (tmp / "recipe.yaml").write_text(recipe_to_yaml(modifiers))
        report = _report(folder, modifiers, plan, tensors, total, results, workers, start)
        report.output_dir = str(Path(output_dir))
        report.notes.extend(notes or ())
        report.options = dict(settings or {})
        from layerwise.reports.model_card import output_card_files
        from layerwise.reports.run_summary import SUMMARY_FILE, summary_json

        (tmp / SUMMARY_FILE).write_text(summary_json(report))
        for name, text in output_card_files(report, output_dir).items():  # over the source model's own card
            (tmp / name).write_text(text, encoding="utf-8")
    return report


def _shards(folder: Path, projections: tuple[str, ...] = ()) -> tuple[list[str], dict[str, tuple[str, StoredTensor]]]:
    """The folder's safetensors files and every tensor's (file, location), from the headers alone; fused MoE experts
    split into per-expert weights by ``projections`` (:func:`~.experts.split_experts`; none: left whole)."""
    index = folder / INDEX_FILE
    if index.is_file():
        files = list(dict.fromkeys(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / SINGLE_FILE).is_file():
        files = [SINGLE_FILE]
    else:
        found = sorted(p.name for p in folder.iterdir() if p.suffix in WEIGHT_SUFFIXES)
        raise ModelFreeError(f"{str(folder)!r} has no {SINGLE_FILE} or {INDEX_FILE}"
                             f"{' (it has ' + ', '.join(found) + ')' if found else ''}: model-free compression reads "
                             f"safetensors only; save the model with save_pretrained() first")
    tensors: dict[str, tuple[str, StoredTensor]] = {}
    headers = {file: read_header(folder / file) for file in files}  # each file's header read once
    try:
        if projections:
            check_experts_pairs({name: stored for header in headers.values() for name, stored in header.items()})
        for file, header in headers.items():
            for name, stored in split_experts(header, projections).items():
                if name in tensors:
                    raise FusedExpertsError(f"{name!r} is in {tensors[name][0]} and {file} (split from fused experts)")
                tensors[name] = (file, stored)
    except FusedExpertsError as exc:
        raise ModelFreeError(str(exc)) from None
    return files, tensors


def _layer_jobs(modifiers: list, all_layers: dict[str, Layer], extra_ignore: list[str]) -> dict[str, LayerJob]:
    """Each selected layer's job, from data-free quantization modifiers; anything else is refused."""
    jobs: dict[str, LayerJob] = {}
    for modifier in modifiers:
        owner = type(modifier).__name__
        args = getattr(modifier, "args", None)
        if modifier.requires_data or args is None or not hasattr(modifier, "targets") or (
                type(modifier).quantize_module is not _data_free_quantize_module(modifier)):
            raise ModelFreeError(
                f"{owner} cannot run model-free: model-free compression applies data-free round-to-nearest schemes "
                f"(QuantizationModifier with W4A16, W4A16_ASYM, W8A16, W8A8, FP8_DYNAMIC, FP8_BLOCK, ...); "
                f"{'it needs calibration data' if modifier.requires_data else 'it is not one'}: run without "
                f"--model-free (weights memory or stream)")
        inputs = getattr(modifier, "input_args", None)
        warn_unmatched_ignore(modifier.ignore, list(all_layers), owner)
        try:
            selected = select(all_layers, list(modifier.targets), [*modifier.ignore, *extra_ignore], owner)
        except SelectionError as exc:
            raise ModelFreeError(str(exc)) from None
        for module in selected:
            layer = all_layers[module]
            if args.float_format is not None and layer.columns % args.group_size:
                raise ModelFreeError(f"{owner}: {args.float_format.upper()} scales blocks of {args.group_size} input "
                                     f"columns, which do not divide in_features {layer.columns} of layer {module!r}; "
                                     f"add {module!r} to ignore, or use an integer scheme")
            if args.strategy == "group" and layer.columns % args.group_size:
                divisors = [g for g in (32, 64, 128) if layer.columns % g == 0]
                alt = f", or group_size {divisors[-1]}" if divisors else ""
                raise ModelFreeError(f"{owner}: group_size {args.group_size} does not divide in_features "
                                     f"{layer.columns} of layer {module!r}; use strategy: channel{alt}, or add "
                                     f"{module!r} to ignore")
            if inputs is not None and inputs.strategy == "group" and layer.columns % inputs.group_size:
                raise ModelFreeError(f"{owner}: input_activations group_size {inputs.group_size} does not divide the "
                                     f"{layer.columns} inputs of layer {module!r}; add it to ignore")
            if module in jobs:
                raise ModelFreeError(f"layer {module!r} is selected by two modifiers; give each its own targets")
            jobs[module] = LayerJob(module, args, inputs)
    return jobs


def _data_free_quantize_module(modifier: Any) -> Any:
    """The round-to-nearest ``quantize_module`` of the registered ``QuantizationModifier``: a subclass that
    overrides it (AWQ, GPTQ) computes something :mod:`.worker` does not."""
    from layerwise.host.plugin_manager import registry

    try:
        return registry("modifiers").get("QuantizationModifier").quantize_module
    except LayerwiseError:
        return None


def _workers(asked: int | None, shards: list[str], per_worker: int) -> int:
    """How many shards at once: asked for, else one per shard and core; fewer when memory is short for workers
    of ``per_worker`` bytes each (:func:`worker_memory`)."""
    free = memory_policy.available_memory()
    if free is not None and per_worker > free:
        raise ModelFreeError(f"a model-free worker needs ~{_size(per_worker)} (its largest chunk of a layer's rows "
                             f"in float32 x {WORK_COPIES}, the whole layer for per-tensor ranges), {_size(free)} is "
                             f"available: free memory, or quantize the layers with per-tensor ranges per channel")
    count = asked if asked is not None else min(len(shards), os.cpu_count() or 1)
    if asked is not None and asked < 1:
        raise ModelFreeError(f"workers must be 1 or more, got {asked}")
    if free is not None:
        count = min(count, max(1, free // max(per_worker, 1)))
    return max(1, min(count, len(shards)))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.2f} MiB"


def worker_memory(shards: list[str], by_file: dict[str, list[LayerJob]], all_layers: dict[str, Layer]) -> int:
    """One worker's peak beside the process: its largest chunk of rows (:func:`~.worker.chunk_rows`) as read and
    in float32 times :data:`WORK_COPIES`. Its output is written as it is made, never held."""
    observers: dict = {}
    peak = 0
    for jobs in by_file.values():
        for job in jobs:
            layer = all_layers[job.module]
            values = chunk_rows(layer.rows, layer.columns, job, observers) * layer.columns
            peak = max(peak, values * (4 * WORK_COPIES + layer.stored.nbytes // max(layer.rows * layer.columns, 1)))
    return peak


def _with_global_scales(plan: dict[str, LayerJob], all_layers: dict[str, Layer],
                        patch: ModelPatch | None = None) -> dict[str, LayerJob]:
    """NVFP4 jobs with their global scale: from the largest magnitude of the layer and of the projections fused
    with it (:func:`~layerwise.algorithms.quantization.global_scales.fused_groups`, with ``patch``'s declared
    sets), as the in-memory run computes it (the same maximum, read a chunk at a time); other jobs unchanged."""
    from layerwise.algorithms.quantization.float_formats import nvfp4_global_scale
    from layerwise.algorithms.quantization.global_scales import fused_groups, fused_sets

    by_args: dict[Any, list[str]] = {}
    for name, job in plan.items():
        if job.weights.float_format == "nvfp4":
            by_args.setdefault(job.weights, []).append(name)
    if not by_args:
        return plan
    plan = dict(plan)
    fused = fused_sets(patch.shared_scale_sets() if patch is not None else ())
    for names in by_args.values():
        for group in fused_groups(names, fused):
            amax = torch.stack([layer_amax(all_layers[n].stored.path, all_layers[n].stored) for n in group]).amax()
            scale = nvfp4_global_scale(amax)
            for name in group:
                plan[name] = dataclasses.replace(plan[name], global_scale=scale)
    return plan


def _run(jobs: list[ShardJob], workers: int) -> list[ShardResult]:
    """Every shard's result, in order, ``workers`` shards at a time.

    Threads, not processes: the work is torch kernels and file copies, which release the GIL, and one
    interpreter is held once (measured in ``bench/model_free_bench.py``: forked workers each carried their
    own ~350 MiB of interpreter, torch and plugins, 1.2-1.7x llm-compressor's peak; threads do not)."""
    if workers == 1:
        return [run_shard(job) for job in jobs]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="layerwise-shard") as pool:
        return list(pool.map(run_shard, jobs))


def _copy_other_files(folder: Path, tmp: Path) -> None:
    """Every file of the model folder but its weights and their index (tokenizer, generation config, ...)."""
    for path in folder.iterdir():
        if path.is_file() and not path.name.startswith(".") and path.suffix not in WEIGHT_SUFFIXES \
                and path.name not in (INDEX_FILE, "config.json"):
            shutil.copy2(path, tmp / path.name)


def _shadow_model(all_layers: dict[str, Layer], jobs: dict[str, LayerJob]) -> torch.nn.Module:
    """Meta ``nn.Linear`` modules named as the checkpoint's layers (embeddings aside), the quantized ones marked
    with their args: what the saver's config builder reads of a model."""
    from layerwise.model_io.model_free.selection import is_embedding

    root = torch.nn.Module()
    for name in all_layers:
        if is_embedding(name):
            continue
        parent = root
        *path, last = name.split(".")
        for part in path:
            child = parent._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                parent.add_module(part, child)
            parent = child
        linear = torch.nn.Linear(1, 1, bias=False, device="meta")
        job = jobs.get(name)
        if job is not None:
            linear.quantization_args = job.weights
            if job.inputs is not None:
                linear.input_quantization_args = job.inputs
        parent.add_module(last, linear)
    return root


def _ignore_entries(modifiers: list, extra: list[str] | None) -> list[str]:
    """The recipe's ignore entries (and ``ignore``): kept in the config's ignore list, as a module the
    checkpoint does not hold (a tied ``lm_head``) still exists in the model that loads it."""
    entries = [entry for m in modifiers for entry in getattr(m, "ignore", [])] + list(extra or [])
    return list(dict.fromkeys(entries))


def _architecture(folder: Path) -> str:
    """The first class ``config.json`` names in ``architectures`` ('' when it names none)."""
    try:
        names = json.loads((folder / "config.json").read_text()).get("architectures") or [""]
    except (OSError, ValueError, AttributeError):
        return ""
    return str(names[0])


def _report(folder: Path, modifiers: list, jobs: dict[str, LayerJob], tensors: dict[str, tuple[str, StoredTensor]],
            total: int, results: list[ShardResult], workers: int, start: float) -> Any:
    from layerwise.reports.run_report import CompressionReport

    report = CompressionReport(
        pipeline="model-free", modifiers=[type(m).__name__ for m in modifiers], compressed_modules=list(jobs),
        seconds=time.perf_counter() - start, bytes_before=sum(s.nbytes for _, s in tensors.values()),
        bytes_after=total, calibration_samples=0, model=str(folder), recipe=recipe_to_yaml(modifiers),
        weights=f"model-free ({len(results)} shard(s), {workers} worker(s))", activations="none",
        targets_found="none (no model class: layers selected by tensor name)", targets_source="none",
        architecture=_architecture(folder))
    report.peak_rss_bytes = max([_own_peak(), *(r.peak_rss_bytes for r in results)])
    report.accounting = {"shards": {"seconds": round(sum(r.seconds for r in results), 4), "flops": 0.0,
                                    "calls": len(results), "gflops_per_second": None}}
    return report


def _own_peak() -> int:
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
