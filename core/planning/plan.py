"""``make_plan``: everything a run can be told before it starts, from shapes alone.

The model is built on the meta device from its config (:mod:`.model_shape`); the recipe's
modifiers resolve their layers and mappings on it with the methods a run calls
(``resolve_modules``, :func:`~layerwise.algorithms.quantization.mappings.mappings_for_run`), so
a target or mapping that matches nothing is the same error here as an hour into a run. What is
found wrong is a :class:`Finding` of level ``error``; a plan with none runs as asked.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from layerwise.common.module_walk import walk_modules, walks_cached
from layerwise.errors import LayerwiseError
from layerwise.host.patch_selection import use_patch
from layerwise.host.pipeline import blocks_reason
from layerwise.host.pipeline_selection import check_requested_pipeline
from layerwise.host.recipe import RecipeLike, parse_recipe
from layerwise.host.state import CompressionState
from layerwise.model_io.calibration_data import default_max_seq_length
from layerwise.model_io.model_paths import check_model_path, check_not_quantized
from layerwise.model_io.saving import check_not_an_input, check_output_dir, run_inputs
from layerwise.model_io.streaming.shards import MAX_SHARD_BYTES
from layerwise.model_io.streaming.stream import IN_MEMORY_PEAK, should_stream
from layerwise.planning.estimate import (
    PieceEstimate,
    Quantized,
    cut_cache_bytes,
    estimate_piece,
    forward_flops,
    hessian_flops,
    rotary_width,
    solve_flops,
    stored_weight_bytes,
)
from layerwise.planning.hardware import (
    GPU,
    Rates,
    find_gpu,
    matmul_rate,
    measured_rates,
    present_gpu,
    table_rates,
)
from layerwise.planning.hardware import (
    gpu_key as _gpu_key,
)
from layerwise.planning.model_shape import CheckpointInfo, meta_model
from layerwise.planning.serving import (
    TABLE_DATE,
    Serving,
    expert_group,
    vllm_kv_cache_support,
    vllm_support,
)
from layerwise.runtime import memory_policy
from layerwise.runtime.devices import free_memory
from layerwise.runtime.memory_policy import (
    cache_bytes,
    hidden_size,
    offload_to_disk,
)
from layerwise.runtime.placement import DEVICE_MEMORY_FRACTION, plan_placement, working_set_bytes
from layerwise.tracing.targets import check_entries, choose_targets, resolve_modules


class PlanError(LayerwiseError):
    """The run would not run as asked (the plan's errors, each with its fix)."""


@dataclass(frozen=True)
class Finding:
    """One thing the plan found: ``error`` (the run would fail), ``warning`` or ``note``."""

    level: str
    text: str
    #: what it is about: ``memory`` (a placement that does not fit), else ``""``
    topic: str = ""
    #: the error a run would raise for it (re-raised by ``compress()``'s preflight), when there is one
    exception: BaseException | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Choice:
    """One way to place a run: where weights and cached activations rest, and what that needs."""

    weights: str
    offload: str
    host_peak: int
    disk: int
    fits: bool


@dataclass
class Plan:
    """What ``layerwise plan`` reports; :attr:`ok` is the verdict."""

    model: str
    architecture: str = ""
    patch: str | None = None
    dtype: torch.dtype = torch.float32
    targets: tuple[str, ...] = ()
    targets_found: str = ""
    ignore: list[str] = field(default_factory=list)
    pieces: list[PieceEstimate] = field(default_factory=list)
    targets_per_piece: int = 1
    mappings: dict[str, list[str]] = field(default_factory=dict)
    layers: dict[str, Quantized] = field(default_factory=dict)
    samples: int = 0
    seq_length: int = 0
    checkpoint: CheckpointInfo | None = None
    weight_bytes: int = 0
    output_bytes: int = 0
    cache_bytes: int = 0
    #: where the sequential pipeline will cut (``layers`` / ``blocks``; ``""``: no data) and why
    cut: str = ""
    cut_reason: str = ""
    #: the widest Linear's larger side (the runtime's working-set rule reads it)
    widest_linear: int = 0
    #: on a GPU: what the run will hold there at its peak, and its parts (resident weights, cached
    #: activations kept there, the largest piece's work); ``None``: not a GPU run, or its memory unknown
    gpu_peak: int | None = None
    gpu_peak_parts: tuple[int, int, int] = (0, 0, 0)
    gpu_placement: str = ""
    baseline_bytes: int = 0
    host_memory: int | None = None
    host_memory_source: str = ""
    disk_free: int | None = None
    device: str = "cpu"
    gpu_budget: int | None = None
    choices: list[Choice] = field(default_factory=list)
    chosen: Choice | None = None
    auto_note: str = ""
    flops: dict[str, float] = field(default_factory=dict)
    rates: Rates | None = None
    serve_on: GPU | None = None
    serving: list[tuple[str, int, Serving]] = field(default_factory=list)
    #: the KV cache's scheme as the plan prints it (FP8 KV cache / FP8 attention), and vLLM's answer for it
    kv_cache: str = ""
    kv_serving: Serving | None = None
    #: weights="model-free": the run's forecast (shards, workers, memory per worker), no model built
    model_free: Any = None
    #: the uncompressed model's second stream of activations (GPTAQ, AutoRound match: model): the cache twice
    reference_stream: bool = False
    #: the calibration tokens, counted by tokenizing the data as the run will (``None``: not counted, every
    #: sample taken at ``seq_length``: no tokenizer with the model, or ``compress``'s own checks)
    tokens_counted: int | None = None
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def errors(self) -> list[str]:
        return [f.text for f in self.findings if f.level == "error"]

    @property
    def seconds(self) -> float | None:
        if self.rates is None:
            return None
        # a GPU takes a half-precision model's Hessians on its tensor cores, at the model's rate (gram_dtype)
        tensor_cores = self.device == "cuda" and self.dtype in (torch.bfloat16, torch.float16)
        return ((self.flops.get("forwards", 0.0) + self.flops.get("tuning steps", 0.0)) / self.rates.model_dtype
                + self.flops.get("Hessians", 0.0) / (self.rates.model_dtype if tensor_cores else self.rates.fp32)
                + self.flops.get("solves", 0.0) / self.rates.fp32)

    def verdict(self) -> str:
        if not self.ok:
            return "verdict: will not run as asked: " + "; ".join(self.errors)
        where = f"weights {self.chosen.weights}, activations {self.chosen.offload}" if self.chosen else ""
        time = f", ~{_duration(self.seconds)}" if self.seconds is not None else ""
        serving = ""
        if self.serve_on is not None and self.serving:
            worst = min((s.status for _, _, s in self.serving), key=["none", "fallback", "native"].index)
            serving = f", serves on {self.serve_on.name} ({worst} kernels)"
        return f"verdict: runs as asked ({where}{time}{serving})"

    def error(self, text: str, topic: str = "") -> None:
        self.findings.append(Finding("error", text, topic))

    def note(self, text: str, level: str = "note") -> None:
        self.findings.append(Finding(level, text))

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """A layerwise error inside the block becomes an error finding (the plan goes on)."""
        try:
            yield
        except LayerwiseError as exc:
            self.findings.append(Finding("error", str(exc), exception=exc))


def make_plan(model: torch.nn.Module | str | os.PathLike, recipe: RecipeLike = "W4A16", dataset: Any = None, *,
              options: Any, output_dir: str | os.PathLike | None = None, gpu_memory: int | None = None,
              host_memory: int | None = None, serve_on: str | None = None, measure: bool = True) -> Plan:
    """The plan of ``compress(model, recipe, dataset, output_dir=..., options=options)``.

    ``options`` is a :class:`~layerwise.verbs.options.CompressOptions` (everyday arguments folded in).
    ``gpu_memory`` / ``host_memory`` (bytes) plan for another machine; ``serve_on`` names the GPU the
    output will be served on (:data:`~layerwise.planning.hardware.GPUS`). ``measure=False`` leaves out
    the matmul measurement and the count of the calibration tokens (``compress`` checks without them:
    every sample is then counted at ``max_seq_length``, an upper bound).

    The garbage collector is paused meanwhile: a 671B MoE model on meta is ~60,000 modules, and the
    collections its building and walking trigger each traverse all of them (half the plan's time).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _make_plan(model, recipe, dataset, options=options, output_dir=output_dir, gpu_memory=gpu_memory,
                          host_memory=host_memory, serve_on=serve_on, measure=measure)
    finally:
        if enabled:
            gc.enable()


def _make_plan(model: torch.nn.Module | str | os.PathLike, recipe: RecipeLike, dataset: Any, *, options: Any,
               output_dir: str | os.PathLike | None, gpu_memory: int | None, host_memory: int | None,
               serve_on: str | None, measure: bool) -> Plan:
    calibration, placement, output, safety = options.calibration, options.placement, options.output, options.safety
    modifiers = parse_recipe(recipe)
    plan = Plan(model=str(model) if not isinstance(model, torch.nn.Module) else type(model).__name__)
    plan.serve_on = find_gpu(serve_on) if serve_on else None
    if plan.serve_on is not None and _gpu_key(serve_on) != _gpu_key(plan.serve_on.name):  # GH200 -> H200
        plan.note(f"--serve-on {serve_on!r} is read as {plan.serve_on.name}, the closest GPU in the table")
    if placement.weights == "model-free" and not isinstance(model, torch.nn.Module):
        _model_free_plan(plan, model, recipe, options, output_dir, host_memory)
        _serving(plan, placement)
        return plan
    info = None
    if not isinstance(model, torch.nn.Module):
        check_model_path(model)
        with plan.checking():
            check_not_quantized(model)
        model, info = meta_model(model, calibration.patch, safety.trust_remote_code)
    plan.checkpoint = info
    patch = use_patch(model, calibration.patch)
    with walks_cached(model):  # the model is fixed from here: ~10 walks of it become one
        plan.architecture, plan.patch = type(model).__name__, patch.name if patch is not None else None
        plan.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        if output_dir is not None:
            with plan.checking():
                check_not_an_input(output_dir, run_inputs(plan.model if info is not None else model, dataset, recipe))
                check_output_dir(output_dir, output.overwrite)

        given = list(calibration.sequential_targets) if calibration.sequential_targets is not None else None
        targets: dict[str, torch.nn.Module] = {}
        with plan.checking():
            choice = choose_targets(model, given, patch)
            plan.targets, plan.targets_found = choice.targets, choice.describe(model)
            targets = resolve_modules(model, list(choice.targets)) if choice.targets else {}
        with plan.checking():
            if calibration.ignore is not None:
                check_entries(model, list(calibration.ignore), "ignore entry")
        with plan.checking():
            check_requested_pipeline(calibration.pipeline, modifiers)
        plan.ignore = list(calibration.ignore) if calibration.ignore is not None else list(patch.ignore if patch else [])
        state = CompressionState(model=model, modifiers=modifiers, patch=patch, sequential_targets=list(plan.targets),
                                 ignore=list(plan.ignore))
        _resolve_modifiers(plan, model, patch, modifiers, state)

        needs_data = any(m.requires_data for m in modifiers)
        plan.seq_length = calibration.max_seq_length or default_max_seq_length(model)
        plan.samples = calibration.num_calibration_samples if needs_data else 0
        if needs_data and isinstance(dataset, (list, tuple)):  # samples given as such: the run takes at most these
            plan.samples = min(plan.samples, len(dataset))
        tokens = plan.samples * plan.seq_length
        counted = _count_tokens(plan, dataset, calibration, safety.trust_remote_code) if needs_data and measure else None
        if counted is not None:
            plan.samples, tokens = counted
            plan.tokens_counted = tokens
        element = torch.empty((), dtype=plan.dtype).element_size()
        hidden = hidden_size(model.config) if hasattr(model, "config") else 0
        plan.reference_stream = any(getattr(m, "needs_reference_inputs", False) for m in modifiers)
        if needs_data:
            plan.cut, plan.cut_reason = _cut(modifiers, plan.layers, calibration)
        widest_read = max((layer.columns for layer in plan.layers.values()), default=hidden)
        one_length = plan.samples > 0 and tokens == plan.samples * plan.seq_length  # every sample full: one cos/sin
        plan.cache_bytes = cut_cache_bytes(tokens, element, hidden=hidden, widest_read=widest_read, cut=plan.cut,
                                           rotary=rotary_width(model.config) if hasattr(model, "config") else 0,
                                           rotary_tokens=plan.seq_length if one_length else None) \
            * (2 if plan.reference_stream else 1)
        plan.targets_per_piece = calibration.targets_per_subgraph
        awq_tokens = max((int(getattr(m, "search_tokens", 0)) for m in modifiers if hasattr(m, "mappings")), default=0)
        plan.pieces, plan.widest_linear = _pieces(model, targets, calibration.targets_per_subgraph, plan.layers,
                                                  dtype=plan.dtype, seq_length=plan.seq_length if needs_data else 0,
                                                  hidden=hidden, awq_tokens=awq_tokens)
        plan.weight_bytes = sum(piece.weights for piece in plan.pieces)
        quantized = [layer for layer in plan.layers.values() if layer.weights is not None]
        plan.output_bytes = plan.weight_bytes + sum(stored_weight_bytes(layer, element) - layer.rows * layer.columns
                                                    * element for layer in quantized)
        _memory(plan, model, info, placement, output_dir, needs_data, gpu_memory, host_memory)
        _time(plan, model, modifiers, needs_data, tokens, hidden, placement, calibration, gpu_memory, measure)
        _serving(plan, placement)
        _kv_cache(plan, modifiers)
        return plan


def _resolve_modifiers(plan: Plan, model: torch.nn.Module, patch: Any, modifiers: list, state: CompressionState) -> None:
    """Each modifier's layers (its own ``resolve_modules``) and smoothing mappings, as a run resolves them."""
    from layerwise.algorithms.quantization.mappings import mappings_for_run
    from layerwise.algorithms.quantization.storage import linear_weight
    from layerwise.common.matching import find_modules, has_weight, unmatched
    from layerwise.tracing.smoothing_layout import discover_mappings

    caches = []  # one per modifier that calibrates the KV cache (its kv_cache_scheme, or its attention_scheme)
    for m in modifiers:
        key = next((k for k in ("kv_cache_scheme", "attention_scheme") if getattr(m, k, None) is not None), None)
        if key is not None:
            caches.append(f"{type(m).__name__}.{key}: {getattr(m, key)!r}")
    if len(caches) > 1:  # each would calibrate the same k/v scales, and the last one's would be saved
        plan.error(f"the KV cache is set twice ({', '.join(caches)}): keep one (a recipe's kv_cache_scheme, or "
                   f"the CLI's --kv-cache)")
    for modifier in modifiers:
        owner = type(modifier).__name__
        hessian = hasattr(type(modifier), "hessian_phase")
        with plan.checking():
            if hasattr(modifier, "mappings"):
                resolved = mappings_for_run(model, patch, modifier.mappings, owner=owner, discover=discover_mappings)
                plan.mappings[owner] = [f"{m.smoothed} -> {', '.join(m.balance)}" for m in resolved]
            if hasattr(modifier, "resolve_modules"):
                modules = modifier.resolve_modules(state)
            elif getattr(modifier, "targets", None):
                missing = unmatched(model, modifier.targets)
                if missing:
                    raise PlanError(f"{owner}: target(s) {', '.join(map(repr, missing))} match no module of "
                                    f"{type(model).__name__}")
                modules = {n: m for n, m in find_modules(model, modifier.targets,
                                                         [*getattr(modifier, "ignore", []), *state.ignore]).items()
                           if has_weight(m)}
            else:
                continue
            weights, inputs = getattr(modifier, "args", None), getattr(modifier, "input_args", None)
            for name, module in modules.items():
                shape = linear_weight(module).shape
                rows, columns = int(shape[0]), int(shape[1])
                known = plan.layers.get(name)
                plan.layers[name] = Quantized(name, rows, columns, weights or (known.weights if known else None),
                                              inputs or (known.inputs if known else None),
                                              hessian or (known.hessian if known else False))


def _pieces(model: torch.nn.Module, targets: dict[str, torch.nn.Module], per_piece: int, layers: dict[str, Quantized],
            **sizes: Any) -> tuple[list[PieceEstimate], int]:
    """One estimate per piece: ``per_piece`` consecutive targets, then the rest of the model (run only when it
    holds a compressed layer), and the widest Linear's larger side. Parameters, Linear widths and compressed
    layers go to their piece by their names' prefixes, in one pass each."""
    names = list(targets)
    group_of = {name: position // per_piece for position, name in enumerate(names)}
    size = torch.empty((), dtype=sizes["dtype"]).element_size()
    weights: dict[int, int] = {}
    members: dict[int, list[str]] = {}
    widest: dict[int, int] = {}
    widest_linear = 0
    module_group: dict[str, int] = {}
    seen: set[int] = set()
    for name, module in walk_modules(model):  # parents first: a module's piece is its own or its parent's
        group = group_of.get(name, module_group.get(name.rpartition(".")[0], -1) if name else -1)
        module_group[name] = group
        if isinstance(module, torch.nn.Linear):
            rows, columns = module._parameters["weight"].shape  # not module.weight: nn.Module's slow lookup
            widest[group] = max(widest.get(group, 0), rows)
            widest_linear = max(widest_linear, rows, columns)
        for param in module._parameters.values():  # a tied parameter once, as a checkpoint holds it
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            weights[group] = weights.get(group, 0) + param.numel() * (size if param.is_floating_point()
                                                                      else param.element_size())
            if group < 0 and (not members.get(group) or members[group][-1] != name):
                members.setdefault(group, []).append(name)
    held: dict[int, list[Quantized]] = {}
    for name, layer in layers.items():
        group = module_group[name] if name in module_group else group_of_module(name, group_of)
        held.setdefault(group, []).append(layer)
    pieces = []
    for group, start in enumerate(range(0, len(names), per_piece)):
        chosen = names[start:start + per_piece]
        label = chosen[0] if len(chosen) == 1 else f"{chosen[0]} .. {chosen[-1]}"
        pieces.append(estimate_piece(label, chosen, held.get(group, []), weights=weights.get(group, 0),
                                     widest=widest.get(group, 0), **sizes))
    if -1 in weights or not pieces:
        pieces.append(estimate_piece("the rest (embeddings, head, ...)" if names else "the whole model",
                                     members.get(-1, [""]), held.get(-1, []), weights=weights.get(-1, 0),
                                     widest=widest.get(-1, 0), **sizes))
        pieces[-1].runs = not names or bool(held.get(-1))
    return pieces, widest_linear


def group_of_module(name: str, group_of: dict[str, int]) -> int:
    """The piece holding module ``name`` (``-1``: none, the rest of the model)."""
    parts = name.split(".")
    return next((group_of[p] for p in (".".join(parts[:i]) for i in range(len(parts), 0, -1)) if p in group_of), -1)


def current_rss() -> int:
    """This process's resident memory now (torch and transformers imported: every run's floor)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _memory(plan: Plan, model: torch.nn.Module, info: CheckpointInfo | None, placement: Any,
            output_dir: Any, needs_data: bool, gpu_memory: int | None, host_memory: int | None) -> None:
    """Host RAM per placement choice, the device's need per piece, disk, and what ``auto`` picks."""
    _machine(plan, output_dir, host_memory)
    on_gpu = gpu_memory is not None or (placement.device or "").startswith("cuda") or (
        placement.device is None and torch.cuda.is_available())
    plan.device = "cuda" if on_gpu else "cpu"
    work = max((p.activations + p.statistics + p.temporary for p in plan.pieces if p.runs), default=0)
    largest_piece = max((p.weights for p in plan.pieces), default=0)
    element = torch.empty((), dtype=plan.dtype).element_size()
    quantized_out = plan.output_bytes - plan.weight_bytes + sum(
        layer.rows * layer.columns * element for layer in plan.layers.values() if layer.weights is not None)
    on_host = 0 if on_gpu else work
    can_stream = info is not None
    for weights in ("memory", "stream") if can_stream else ("memory",):
        for offload in ("cpu", "disk") if needs_data else ("cpu",):
            cache = plan.cache_bytes if offload == "cpu" and needs_data else 0
            if weights == "memory":
                peak = plan.baseline_bytes + plan.weight_bytes + max(cache + on_host, quantized_out)
            else:
                peak = plan.baseline_bytes + 2 * largest_piece + cache + on_host
            disk = (_output_disk(plan.output_bytes, streamed=weights == "stream") if output_dir is not None else 0) \
                + (plan.cache_bytes if offload == "disk" and needs_data else 0)
            plan.choices.append(_choice(plan, weights, offload, peak, disk))
    weights = placement.weights
    if weights == "auto":
        streams = can_stream and isinstance(plan.model, str) and should_stream(plan.model, plan.host_memory)[0]
        weights = "stream" if streams else "memory"
        plan.auto_note = (f"weights auto -> {weights} (stream when {IN_MEMORY_PEAK}x the checkpoint exceeds the "
                          f"memory)" if can_stream else
                          "weights auto -> memory (no safetensors checkpoint here to stream from)")
    elif weights == "stream" and not can_stream:
        from layerwise.model_io.streaming.checkpoint import Checkpoint

        with plan.checking():  # the run's own error: what the folder has, and the fix
            Checkpoint(plan.model)
            plan.error("weights='stream' reads a model folder's safetensors; pass the folder, or weights='memory'")
        weights = "memory"
    offload = placement.offload
    if offload == "auto":
        runtime_estimate = cache_bytes(plan.samples * plan.seq_length, hidden_size(getattr(model, "config", None)),
                                       element)
        offload = "disk" if offload_to_disk(runtime_estimate * (2 if plan.reference_stream else 1),
                                            plan.host_memory) else "cpu"
        plan.auto_note += f"; offload auto -> {offload} (disk when the cache exceeds half the memory)"
    offload = offload if needs_data else "cpu"
    plan.chosen = next((c for c in plan.choices if c.weights == weights and c.offload == offload), None)
    if plan.chosen is not None and not plan.chosen.fits:
        fitting = [f"weights={c.weights} offload={c.offload}" for c in plan.choices if c.fits]
        short_of_disk = plan.disk_free is not None and plan.chosen.disk > plan.disk_free
        need = (f"~{_gib(plan.chosen.disk)} of disk ({_gib(plan.disk_free)} free)" if short_of_disk else
                f"~{_gib(plan.chosen.host_peak)} of memory ({_gib(plan.host_memory)} {plan.host_memory_source})")
        fixes = ("free disk there, or another output folder" if short_of_disk else
                 "fewer samples or shorter ones, or a larger machine" if needs_data else
                 "a larger machine, or a model-free run (--model-free: one shard at a time, from safetensors)")
        plan.error(f"weights={weights}, offload={offload} needs {need}; "
                   + (f"these fit: {', '.join(fitting)}" if fitting else f"no placement fits: {fixes}"),
                   "disk" if short_of_disk else "memory")  # no placement ``auto`` picks writes less output
    if on_gpu:
        free = gpu_memory
        if free is None and torch.cuda.is_available():
            free = free_memory(torch.device(placement.device or "cuda"))
        if free is not None:
            plan.gpu_budget = int(free * DEVICE_MEMORY_FRACTION)
            _gpu_peak(plan, free, largest_piece, work, streamed=weights == "stream")
            largest = max(plan.pieces, key=lambda p: p.total)
            if largest.total > plan.gpu_budget:
                plan.error(f"piece {largest.label} needs ~{_gib(largest.total)} on the GPU, over "
                           f"{DEVICE_MEMORY_FRACTION:.0%} of {_gib(free)}: fewer targets per piece, a shorter "
                           f"max_seq_length, or a larger GPU", "memory")


def _count_tokens(plan: Plan, dataset: Any, calibration: Any, trust_remote_code: bool) -> tuple[int, int] | None:
    """The samples and tokens the run will calibrate on, read and tokenized as it reads them (seconds for
    thousands of samples); ``None`` when that needs a tokenizer the model folder does not have."""
    from layerwise.model_io.calibration_data import batches_from_records, load_records
    from layerwise.model_io.loading import load_tokenizer

    if dataset is None:
        return None
    with plan.checking():
        records = load_records(dataset)
        tokenizer = calibration.tokenizer
        needs_tokenizer = bool(records) and not isinstance(records[0], Mapping)
        if tokenizer is None and needs_tokenizer and os.path.isdir(os.path.expanduser(plan.model)):
            tokenizer = load_tokenizer(plan.model, trust_remote_code)
        if tokenizer is None and needs_tokenizer:
            return None
        batches = batches_from_records(records, tokenizer, calibration.num_calibration_samples, plan.seq_length,
                                       calibration.packing, source=dataset, chat_template=calibration.chat_template)
        return len(batches), sum(int(b["input_ids"].numel()) if "input_ids" in b else plan.seq_length
                                 for b in batches)
    return None


def _output_disk(output_bytes: int, *, streamed: bool) -> int:
    """Disk a run's output takes while it is written: a streamed run writes each piece's part file, then
    copies the parts of each shard (at most :data:`MAX_SHARD_BYTES`) into it before deleting them."""
    return output_bytes + (min(output_bytes, MAX_SHARD_BYTES) if streamed else 0)


def _gpu_peak(plan: Plan, free: int, largest_piece: int, work: int, *, streamed: bool) -> None:
    """What the run will hold on the GPU at its peak: the runtime's own placement rule
    (:func:`~layerwise.runtime.placement.plan_placement`) for the weights and the cached activations kept
    there, and the largest piece's work beside them."""
    working_set = working_set_bytes(plan.seq_length, max(plan.widest_linear, 1))
    device = torch.device("cuda")
    placement = plan_placement(device, plan.weight_bytes, plan.weight_bytes, working_set, free_bytes=free,
                               can_move=not streamed)
    if not placement.weights_moved:
        placement = plan_placement(device, plan.weight_bytes, largest_piece, working_set, free_bytes=free,
                                   can_move=not streamed)
    resident = plan.weight_bytes if placement.weights_moved else largest_piece
    cached = min(plan.cache_bytes, placement.cache_budget)
    plan.gpu_peak, plan.gpu_peak_parts, plan.gpu_placement = resident + cached + work, (resident, cached, work), \
        placement.reason


def _cut(modifiers: list, layers: dict[str, Quantized], calibration: Any) -> tuple[str, str]:
    """Where ``sequential`` will cut, by the rule of its ``layers_read`` as far as the recipe tells (the layer cut
    also needs the model to trace that finely and replay exactly, which only the run checks)."""
    why_not = blocks_reason(calibration.pieces, calibration.propagate_error, calibration.targets_per_subgraph,
                            modifiers)
    if why_not:
        return "blocks", why_not
    if not any(layer.hessian or (layer.inputs is not None and not layer.inputs.dynamic) for layer in layers.values()):
        return "blocks", "no modifier reads layer inputs"
    return "layers", "the modifiers read only layer inputs (blocks if the model does not trace that finely)"


def _model_free_plan(plan: Plan, folder: Any, recipe: RecipeLike, options: Any, output_dir: Any,
                     host_memory: int | None) -> None:
    """``weights="model-free"``: no model is built (any architecture, as the run itself); the shards, the layers
    the recipe selects by tensor name, the workers and their memory, from the safetensors headers."""
    from layerwise.model_io.model_free.run import forecast_model_free, refuse_sequential_targets

    with plan.checking():
        refuse_sequential_targets(options.calibration.sequential_targets)
        check_model_path(str(folder))
        check_not_quantized(str(folder))
        if output_dir is not None:
            check_not_an_input(output_dir, run_inputs(str(folder), None, recipe))
            check_output_dir(output_dir, options.output.overwrite)
        plan.model_free = forecast_model_free(folder, recipe, ignore=options.calibration.ignore,
                                              workers=options.placement.workers, patch=options.calibration.patch)
    forecast = plan.model_free
    if forecast is None:
        return
    plan.architecture, plan.patch = "any (model-free: no model class)", forecast.patch
    from layerwise.model_io.model_free.run import dense_experts_notes

    for note in dense_experts_notes(forecast.dense_experts):
        plan.note(note)
    for job, rows, columns, nbytes in forecast.jobs:
        plan.layers[job.module] = Quantized(job.module, rows, columns, job.weights, job.inputs, False)
    element = max((nbytes // max(rows * columns, 1) for _, rows, columns, nbytes in forecast.jobs), default=2)
    plan.weight_bytes = forecast.source_bytes
    plan.output_bytes = forecast.source_bytes - sum(nbytes for *_, nbytes in forecast.jobs) + sum(
        stored_weight_bytes(layer, element) for layer in plan.layers.values())
    _machine(plan, output_dir, host_memory)
    peak = plan.baseline_bytes + forecast.workers * forecast.per_worker
    disk = plan.output_bytes if output_dir is not None else 0
    plan.chosen = _choice(plan, "model-free", "none", peak, disk)
    plan.choices.append(plan.chosen)
    if not plan.chosen.fits:
        plan.error(f"a model-free run needs ~{_gib(peak)} of memory and {_gib(disk)} of disk "
                   f"({_gib(plan.host_memory)} {plan.host_memory_source}, {_gib(plan.disk_free)} free): fewer "
                   f"workers (--workers 1), or free memory", "memory")


def _machine(plan: Plan, output_dir: Any, host_memory: int | None) -> None:
    """The machine planned for: this process's floor now, the host memory (given, else available) and the disk
    free where the output goes."""
    plan.baseline_bytes = current_rss()
    plan.host_memory = host_memory if host_memory is not None else memory_policy.available_memory()
    plan.host_memory_source = "given" if host_memory is not None else "available now"
    plan.disk_free = _disk_free(output_dir)


def _choice(plan: Plan, weights: str, offload: str, peak: int, disk: int) -> Choice:
    """A placement needing ``peak`` bytes of host memory and ``disk`` bytes of disk, and whether the machine has them."""
    fits = (plan.host_memory is None or peak <= plan.host_memory) and (plan.disk_free is None or disk <= plan.disk_free)
    return Choice(weights, offload, peak, disk, fits)


def _disk_free(output_dir: Any) -> int | None:
    where = Path(output_dir).expanduser().absolute() if output_dir is not None else Path.cwd()
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        return shutil.disk_usage(where).free
    except OSError:
        return None


def _time(plan: Plan, model: torch.nn.Module, modifiers: list, needs_data: bool, tokens: int, hidden: int,
          placement: Any, calibration: Any, gpu_memory: int | None, measure: bool) -> None:
    """FLOPs per phase and the rates to turn them into seconds."""
    hessian_layers = [layer for layer in plan.layers.values() if layer.hessian]
    if needs_data:
        passes = 2 if plan.cut == "blocks" and calibration.propagate_error else 1
        passes += any(getattr(m, "needs_reference_inputs", False) for m in modifiers)  # the original's stream
        layers = max(1, len(plan.pieces) - 1)
        plan.flops["forwards"] = passes * forward_flops(model, tokens, plan.seq_length, layers, hidden)
        steps = _tuning_tokens(modifiers, plan.samples, tokens / max(plan.samples, 1))
        if steps:  # AutoRound: each block's forward and backward (~3 forwards) on every step's samples
            plan.flops["tuning steps"] = 3.0 * forward_flops(model, steps, plan.seq_length, layers, hidden)
    if hessian_layers:
        plan.flops["Hessians"] = hessian_flops(hessian_layers, tokens, plan.device)
        plan.flops["solves"] = solve_flops(hessian_layers)
    if not measure:
        return
    present = present_gpu(torch.device(placement.device or "cuda")) if plan.device == "cuda" else None
    if plan.device == "cuda" and present is not None and present.half_tflops == 0.0 or (
            present is not None and gpu_memory is None):
        plan.rates = measured_rates(torch.device(placement.device or "cuda"), plan.dtype)
    elif plan.device == "cuda":
        gpu = plan.serve_on or present
        plan.rates = table_rates(gpu) if gpu is not None else None
        if gpu is None:
            plan.note("no time estimate: the GPU is not here and none is named (--serve-on H100, ...)")
    else:
        plan.rates = measured_rates(torch.device("cpu"), plan.dtype)
    if plan.flops.get("tuning steps") and plan.rates is not None:
        _advise_step_dtype(plan, modifiers, torch.device(placement.device or plan.device))


#: how much faster bfloat16 must multiply than float32 for the plan to point at AutoRound's step_dtype
STEP_DTYPE_ADVICE_RATIO = 1.5


def _advise_step_dtype(plan: Plan, modifiers: list, device: torch.device) -> None:
    """A float32 model's AutoRound steps in float32 on a device that multiplies bfloat16 much faster (a GPU, a CPU
    with AVX512-BF16 or AMX): a note naming ``step_dtype: bfloat16``, which the incumbents' default matches there."""
    assert plan.rates is not None
    float32_steps = [type(m).__name__ for m in modifiers if getattr(m, "step_dtype", "") is None]
    if plan.dtype != torch.float32 or not float32_steps:
        return
    if plan.rates.source.startswith("measured"):
        bfloat16 = matmul_rate(device, torch.bfloat16)  # plan.rates has float32's
    else:
        gpu = plan.serve_on or present_gpu(device)
        bfloat16 = table_rates(gpu).model_dtype if gpu is not None else 0.0
    ratio = bfloat16 / plan.rates.fp32 if plan.rates.fp32 else 0.0
    if ratio >= STEP_DTYPE_ADVICE_RATIO:
        plan.note(f"{float32_steps[0]} runs its steps in float32 and this device multiplies bfloat16 {ratio:.1f}x "
                  f"faster: step_dtype: bfloat16 autocasts the steps' forward (as auto-round does by default here), "
                  f"0.6-0.76x the step time on a CPU with 3x faster bfloat16, quality unchanged (BENCHMARKS.md, "
                  f"\"AutoRound with bfloat16 steps\")")


def _tuning_tokens(modifiers: list, samples: int, per_sample: float) -> float:
    """Tokens each block runs forward and backward while a modifier tunes it (AutoRound's ``iters`` steps of
    ``batch_size`` samples), beside the final scoring of every sample twice (kept and round-to-nearest: two
    forwards, two thirds of a step's work per token)."""
    total = 0.0
    for modifier in modifiers:
        iters, batch = getattr(modifier, "iters", None), getattr(modifier, "batch_size", None)
        if isinstance(iters, int) and isinstance(batch, int) and iters > 0:
            kept = min(samples, getattr(modifier, "nsamples", samples) or samples)
            total += (iters * min(batch, kept) + 2 * kept / 3) * per_sample
    return total


def _serving(plan: Plan, placement: Any) -> None:
    """Per scheme, whether vLLM has a kernel on the named GPU (or the one here)."""
    gpu = plan.serve_on
    if gpu is None and plan.device == "cuda" and torch.cuda.is_available():
        gpu = present_gpu(torch.device(placement.device or "cuda"))
    # layers share their args objects: count by identity per layer (hashing the args of 45,032 layers costs
    # more than the rest of this), then merge equal args
    schemes: dict[tuple[int, int], tuple[Any, Any]] = {}
    counts: dict[tuple[int, int, bool], int] = {}
    experts: dict[str, set[tuple[int, int]]] = {}  # experts module -> its quantized projections' schemes
    for layer in plan.layers.values():
        if layer.weights is not None:
            owner, ids = expert_group(layer.name), (id(layer.weights), id(layer.inputs))
            schemes[ids] = (layer.weights, layer.inputs)
            key = (*ids, owner is not None)
            counts[key] = counts.get(key, 0) + 1
            if owner is not None:
                experts.setdefault(owner, set()).add(ids)
    if gpu is None:
        if counts:
            plan.note("serving not checked: name the GPU it will be served on (--serve-on H100, A100, L4, ...)")
        return
    distinct = {owner: {schemes[i] for i in ids} for owner, ids in experts.items()}
    mixed = sorted(owner for owner, found in distinct.items() if len(found) > 1)
    if mixed and plan.serve_on is not None:
        plan.error(f"vLLM runs each experts module as one fused layer with one scheme for every projection; "
                   f"{mixed[0]}{f' (and {len(mixed) - 1} more)' if len(mixed) > 1 else ''} mixes "
                   f"{len(distinct[mixed[0]])}: give its gate, up and down projections the same scheme")
    groups: dict[tuple[Any, Any, bool], int] = {}
    for (*ids, expert), count in counts.items():
        key = (*schemes[tuple(ids)], expert)
        groups[key] = groups.get(key, 0) + count
    for (weights, inputs, expert), count in groups.items():
        support = vllm_support(weights, inputs, gpu.capability, expert=expert)
        what = describe_scheme(weights, inputs) + (" (MoE experts)" if expert else "")
        plan.serving.append((what, count, support))
        if not support.serves and plan.serve_on is not None:
            plan.error(f"vLLM has no kernel for {what} on {gpu.name} "
                       f"(compute capability {gpu.capability[0]}.{gpu.capability[1]}): {support.kernel}")


def _kv_cache(plan: Plan, modifiers: list) -> None:
    """The KV cache a modifier calibrates (``kv_cache_scheme``), and whether vLLM serves it on the named GPU."""
    kv = next((c for c in (getattr(m, "kv_calibration", None) for m in modifiers) if c is not None), None)
    if kv is None:
        return
    per = "per KV head" if kv.args.strategy == "attn_head" else "per attention layer"
    plan.kv_cache = (f"FP8 E4M3, static scales {per} ({'q_scale, ' if kv.queries else ''}k_scale, v_scale; "
                     f"{'FP8 attention' if kv.queries else 'vLLM --kv-cache-dtype fp8'})")
    gpu = plan.serve_on
    if gpu is None:
        return
    plan.kv_serving = vllm_kv_cache_support(kv.args, gpu.capability, queries=kv.queries)
    if not plan.kv_serving.serves:
        plan.error(f"vLLM cannot serve this KV cache on {gpu.name} (compute capability {gpu.capability[0]}."
                   f"{gpu.capability[1]}): {plan.kv_serving.kernel}")


def describe_scheme(weights: Any, inputs: Any) -> str:
    """``weights int4 group 128`` / ``weights float8 channel, inputs float8 token dynamic`` /
    ``weights nvfp4 (blocks of 16)``."""
    def one(args: Any) -> str:
        if args.float_format is not None:
            return f"{args.float_format} (blocks of {args.group_size})"
        kind = "float8" if args.type == "float" else f"int{args.num_bits}"
        how = f"group {args.group_size}" if args.strategy == "group" else (
            f"block {args.block_structure[0]}x{args.block_structure[1]}" if args.strategy == "block" else args.strategy)
        return f"{kind} {how}{'' if args.symmetric else ' asym'}"
    text = f"weights {one(weights)}"
    if inputs is not None:
        text += f", inputs {one(inputs)}{' dynamic' if inputs.dynamic else ''}"
    return text


# -- text -------------------------------------------------------------------------------------------------
def _gib(nbytes: int | None) -> str:
    if nbytes is None:
        return "unknown"
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**28 else f"{nbytes / 2**20:.1f} MiB"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "unknown"
    if seconds < 120:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def _flop(value: float) -> str:
    return f"{value / 1e12:.2f} TFLOP" if value >= 1e11 else f"{value / 1e9:.3f} GFLOP"


def plan_lines(plan: Plan, pieces_shown: int = 6) -> list[str]:
    """The plan as the CLI prints it."""
    if plan.model_free is not None:
        return _model_free_lines(plan)
    lines = [f"model:       {plan.model} ({plan.architecture}, {str(plan.dtype).removeprefix('torch.')}, "
             f"built on meta from its config; no weight read)"]
    if plan.checkpoint is not None:
        info = plan.checkpoint
        lines.append(f"checkpoint:  {info.tensors} tensors, {_gib(info.bytes)} in {info.shards} safetensors file(s) "
                     f"(from their headers)")
    lines.append(f"patch:       {plan.patch or 'none'}")
    lines.append(f"targets:     {plan.targets_found or 'none'}")
    lines.append(f"ignore:      {', '.join(plan.ignore) or 'nothing'}")
    within = "; the run cuts each block further, before the layers the modifiers read" if plan.cut == "layers" else ""
    lines.append(f"cut:         {len(plan.pieces)} pieces ({plan.targets_per_piece} target(s) each, then the rest; "
                 f"memory below per piece)" + (f"; the run cuts at {plan.cut}: {plan.cut_reason}{within}"
                                                 if plan.cut else ""))
    for owner, mappings in plan.mappings.items():
        lines.append(f"mappings:    {owner}: {len(mappings)} resolved, e.g. {mappings[0]}")
    if plan.layers:
        by_scheme: dict[str, int] = {}
        for layer in plan.layers.values():
            key = describe_scheme(layer.weights, layer.inputs) if layer.weights is not None else "pruned"
            by_scheme[key] = by_scheme.get(key, 0) + 1
        lines.append("layers:      " + "; ".join(f"{count} x {key}" for key, count in by_scheme.items()))
    if not plan.samples:
        lines.append("data:        none (a data-free recipe)")
    elif plan.tokens_counted is not None:
        lines.append(f"data:        {plan.samples} samples, {plan.tokens_counted:,} tokens (tokenized now, at most "
                     f"{plan.seq_length} each)")
    else:
        lines.append(f"data:        {plan.samples} samples x {plan.seq_length} tokens (each counted at its most: "
                     f"no tokenizer to count them)")
    lines.append("memory per piece on the execution device (weights + activations in flight + statistics + "
                 "largest temporary):")
    shown = plan.pieces if len(plan.pieces) <= pieces_shown else [*plan.pieces[:pieces_shown - 1], plan.pieces[-1]]
    for piece in shown:
        if piece is plan.pieces[-1] and len(plan.pieces) > pieces_shown:
            lines.append(f"  ... {len(plan.pieces) - pieces_shown} more alike")
        lines.append(f"  {piece.label}: {_gib(piece.total)} = {_gib(piece.weights)} + {_gib(piece.activations)} + "
                     f"{_gib(piece.statistics)} + {_gib(piece.temporary)}")
    if plan.gpu_budget is not None:
        lines.append(f"GPU budget:  {_gib(plan.gpu_budget)} ({DEVICE_MEMORY_FRACTION:.0%} of its free memory)")
    if plan.gpu_peak is not None:
        resident, cached, work = plan.gpu_peak_parts
        lines.append(f"GPU peak:    ~{_gib(plan.gpu_peak)} = weights {_gib(resident)} + cached activations "
                     f"{_gib(cached)} + the largest piece's work {_gib(work)} ({plan.gpu_placement})")
    stream = " (two streams: the uncompressed model's beside the compressed one)" if plan.reference_stream else ""
    lines.append(f"cache:       {_gib(plan.cache_bytes)} of activations at a cut{stream}" if plan.samples else
                 "cache:       none")
    lines.append(f"host RAM:    {_gib(plan.host_memory)} {plan.host_memory_source}; process floor "
                 f"{_gib(plan.baseline_bytes)} (measured now)")
    for choice in plan.choices:
        mark = "fits" if choice.fits else "does not fit"
        chosen = "  <- chosen" if choice is plan.chosen else ""
        lines.append(f"  weights={choice.weights:<6} offload={choice.offload:<4} peak ~{_gib(choice.host_peak)}, "
                     f"disk {_gib(choice.disk)}: {mark}{chosen}")
    if plan.auto_note:
        lines.append(f"auto:        {plan.auto_note.lstrip('; ')}")
    lines.append(f"disk:        output ~{_gib(plan.output_bytes)} (from {_gib(plan.weight_bytes)}); "
                 f"{_gib(plan.disk_free)} free there")
    if plan.flops:
        flops = ", ".join(f"{phase} {_flop(value)}" for phase, value in plan.flops.items())
        lines.append(f"work:        {flops}")
    else:
        lines.append("work:        no calibration forwards (round-to-nearest of each weight)")
    if plan.rates is not None:
        lines.append(f"time:        ~{_duration(plan.seconds)} (an estimate; rates {plan.rates.model_dtype / 1e9:.0f} / "
                     f"{plan.rates.fp32 / 1e9:.0f} GFLOP/s, {plan.rates.source})")
    return lines + _closing_lines(plan)


def _closing_lines(plan: Plan) -> list[str]:
    """Serving, notes and the verdict: the end of every plan."""
    lines = []
    if plan.serving:
        gpu = plan.serve_on or "this GPU"
        name = gpu.name if isinstance(gpu, GPU) else gpu
        lines.append(f"serving on {name} (vLLM kernel table of {TABLE_DATE}):")
        for scheme, count, support in plan.serving:
            lines.append(f"  {count} x {scheme}: {support.status} ({support.kernel})")
    if plan.kv_cache:
        served = "" if plan.kv_serving is None else f"; on {plan.serve_on.name}: {plan.kv_serving.status} " \
                                                     f"({plan.kv_serving.kernel})"
        lines.append(f"kv cache:    {plan.kv_cache}{served}")
    for finding in plan.findings:
        if finding.level != "error":
            lines.append(f"{finding.level}: {finding.text}")
    lines.append(plan.verdict())
    return lines


def _model_free_lines(plan: Plan) -> list[str]:
    """A model-free plan: no model, pieces or cache; shards, workers, memory and disk."""
    forecast = plan.model_free
    by_scheme: dict[str, int] = {}
    for layer in plan.layers.values():
        key = describe_scheme(layer.weights, layer.inputs)
        by_scheme[key] = by_scheme.get(key, 0) + 1
    lines = [f"model:       {plan.model} (model-free: no model class is built; safetensors headers only)",
             f"shards:      {forecast.shards}, {_gib(forecast.source_bytes)} in all, the largest "
             f"{_gib(forecast.largest_shard)}",
             "layers:      " + ("; ".join(f"{count} x {key}" for key, count in by_scheme.items()) or "none") +
             " (selected by tensor name)",
             f"workers:     {forecast.workers}, ~{_gib(forecast.per_worker)} each beside the process (a chunk of a "
             f"layer's rows, in float32; each output tensor is written as it is made)"]
    if plan.chosen is not None:
        lines.append(f"host RAM:    peak ~{_gib(plan.chosen.host_peak)} (process floor {_gib(plan.baseline_bytes)} "
                     f"measured now, with what the run imports); {_gib(plan.host_memory)} {plan.host_memory_source}")
        lines.append(f"disk:        output ~{_gib(plan.output_bytes)} (from {_gib(plan.weight_bytes)}); "
                     f"{_gib(plan.disk_free)} free there")
    return lines + _closing_lines(plan)
