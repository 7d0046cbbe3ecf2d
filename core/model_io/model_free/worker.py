"""One shard of a model-free run: its layers quantized a chunk of rows at a time, the rest copied by the kernel.

What is quantized goes through the steps a data-free in-memory run takes (the recipe's observer,
:func:`~layerwise.algorithms.quantization.qmath.weight_qparams`, the qparams stored on a bare
``nn.Linear`` as :mod:`~layerwise.algorithms.quantization.storage` stores them, dynamic input
quantization), then the registered saver's ``encode_module``: the bytes an in-memory run saves
(``tests/model_io/model_free`` compares them). Two differences, both bit for bit the same:

* the fake-quantized weight the in-memory run keeps on its module is never made: the saver quantizes
  the weight as stored with the same qparams, which gives the same integers
  (:func:`~layerwise.algorithms.quantization.storage.set_weight_qparams` says why);
* a layer whose ranges are per row, group or block (min-max observer; every preset but per-tensor
  ones) is read, quantized and encoded a chunk of :data:`CHUNK_ELEMENTS` values at a time: its
  ranges, scales and codes are those of the whole layer, as nothing in them crosses rows. A
  per-tensor range, or an observer that does not promise row independence, takes the layer whole.

Memory: the file is written header first (:mod:`.layout` knows the saver's tensors before any value)
and each chunk's bytes go to their place in it at once, so a worker holds one chunk of the source
(read into a reused buffer) and its float32 work, never its shard's output; tensors left as they are
go from file to file in the kernel.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import weight_qparams
from layerwise.algorithms.quantization.storage import (
    codes_survive_storage,
    set_input_quantization,
    set_quantized_weight,
    set_weight_qparams,
)
from layerwise.model_io.model_free.experts import split_experts
from layerwise.model_io.model_free.layout import EncodedTensor, LayoutError, layer_layout, row_unit
from layerwise.model_io.streaming.safetensors_io import (
    DTYPES,
    StoredTensor,
    StreamedFile,
    TensorLayout,
    layout_of,
    read_header,
)

#: values of a layer quantized at once (4 MiB of float32 work): large enough that a chunk's Python steps
#: cost little beside its kernels, small enough for the work to stay in the CPU's caches
CHUNK_ELEMENTS = 1 << 20
#: chunks between two trims of the C heap (:func:`release_freed_memory`)
TRIM_EVERY = 4
#: strategies whose qparams are per row, group or block of rows (NVFP4's global scale comes with the job)
ROW_STRATEGIES = ("channel", "group", "block", "tensor_group")


@dataclass(frozen=True)
class LayerJob:
    """How one layer is quantized (its module name, weight args, input args, NVFP4 global scale)."""

    module: str
    weights: QuantizationArgs
    inputs: QuantizationArgs | None
    #: NVFP4: the float32 global scale, of the layer or of the projections fused with it
    global_scale: torch.Tensor | None = field(default=None, compare=False)


@dataclass(frozen=True)
class ShardJob:
    """One source shard, where its output goes, its layers to quantize, and the saver's name."""

    source: Path
    target: Path
    layers: tuple[LayerJob, ...]
    save_format: str
    threads: int
    #: the patch's ``expert_projections``: fused MoE experts are split into per-expert layers by them (:mod:`.experts`)
    expert_projections: tuple[str, ...] = ()


@dataclass(frozen=True)
class ShardResult:
    """What a worker wrote: tensor names, data bytes, its seconds and the process's peak memory so far."""

    file: str
    names: tuple[str, ...]
    nbytes: int
    seconds: float
    peak_rss_bytes: int


def linear_holding(weight: torch.Tensor) -> nn.Linear:
    """A bias-less ``nn.Linear`` whose weight is ``weight`` itself (no copy, no init)."""
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = int(weight.shape[1]), int(weight.shape[0])
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = None
    return layer


def observer_for(args: QuantizationArgs, observers: dict[QuantizationArgs, Any]) -> Any:
    """The recipe's observer for ``args`` (one per args, kept in ``observers``)."""
    observer = observers.get(args)
    if observer is None:
        from layerwise.host.plugin_manager import registry

        observer = observers[args] = registry("observers").get(args.observer)(args)
    return observer


@torch.no_grad()
def quantized_layer(weight: torch.Tensor, job: LayerJob, observers: dict[QuantizationArgs, Any]) -> nn.Linear:
    """``weight`` (or rows of it) on a bare Linear with the qparams a data-free ``QuantizationModifier`` gives it;
    the weight itself is left as stored (the saver quantizes it) unless :func:`codes_survive_storage` says the
    in-memory run's fake-quantized weight would encode otherwise."""
    module = linear_holding(weight)
    work = weight.to(torch.float32)
    scale, zero_point = weight_qparams(work, job.weights, observer_for(job.weights, observers), job.global_scale)
    if codes_survive_storage(weight.dtype, job.weights):
        set_weight_qparams(module, scale, zero_point, job.weights, global_scale=job.global_scale)
    else:
        set_quantized_weight(module, work, scale, zero_point, job.weights, global_scale=job.global_scale)
    if job.inputs is not None:
        set_input_quantization(module, job.inputs)  # dynamic only: a model-free recipe has no data
    return module


def chunk_rows(rows: int, columns: int, job: LayerJob, observers: dict[QuantizationArgs, Any]) -> int:
    """Rows quantized at once: a multiple of the layout's row unit near :data:`CHUNK_ELEMENTS` values when the
    layer's qparams are per row, group or block with a row-independent observer, else every row."""
    args = job.weights
    if args.strategy not in ROW_STRATEGIES or not getattr(observer_for(args, observers), "rows_independent", False):
        return rows
    unit = row_unit(args.block_structure[0] if args.strategy == "block" else None)
    return min(rows, max(unit, CHUNK_ELEMENTS // max(columns, 1) // unit * unit))


class _Source:
    """The shard's file, read a byte range at a time into one buffer this worker reuses."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_RDONLY)
        self._buffer = torch.empty(0, dtype=torch.uint8)
        self.chunks = 0  # quantized so far (the heap is trimmed every TRIM_EVERY)

    def rows(self, stored: StoredTensor, first: int, count: int) -> torch.Tensor:
        """Rows ``first .. first + count`` of the 2-D tensor ``stored`` (a view of the buffer: valid until the next
        read)."""
        columns = stored.shape[1]
        size = torch.empty((), dtype=DTYPES[stored.dtype]).element_size()
        nbytes = count * columns * size
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        view = memoryview(self._buffer.numpy())[:nbytes]
        offset, done = stored.start + first * columns * size, 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise OSError(f"{stored.path.name} ended inside a tensor (truncated?)")
            done += got
        return self._buffer[:nbytes].view(DTYPES[stored.dtype]).view(count, columns)

    def close(self) -> None:
        os.close(self._fd)


def run_shard(job: ShardJob) -> ShardResult:
    """Quantize the layers of ``job.source`` and write ``job.target`` (complete or absent)."""
    from layerwise.host.plugin_manager import registry

    start = time.perf_counter()
    if job.threads and torch.get_num_threads() > job.threads:
        torch.set_num_threads(job.threads)  # process-wide: the workers share the cores
    saver = registry("savers").get(job.save_format)
    stored = split_experts(read_header(job.source), job.expert_projections)
    by_tensor = {f"{layer.module}.weight": layer for layer in job.layers}
    observers: dict[QuantizationArgs, Any] = {}
    layouts: dict[tuple, list[EncodedTensor]] = {}
    planned: dict[str, list[EncodedTensor]] = {}
    file_layout: dict[str, TensorLayout] = {}
    for name, where in stored.items():
        layer = by_tensor.get(name)
        if layer is None:
            file_layout[name] = layout_of(where)  # copied byte for byte
            continue
        planned[name] = _layout(where, layer, saver, observers, layouts)
        for tensor in planned[name]:
            file_layout[f"{layer.module}.{tensor.key}"] = tensor.layout
    source = _Source(job.source)
    try:
        with StreamedFile(job.target, file_layout) as out:
            for name, where in stored.items():
                layer = by_tensor.get(name)
                if layer is None:
                    out.copy(name, where)
                else:
                    _write_layer(out, source, where, layer, planned[name], saver, observers)
    finally:
        source.close()
    return ShardResult(job.target.name, tuple(file_layout), out.nbytes, time.perf_counter() - start, _peak_rss())


def _layout(where: StoredTensor, job: LayerJob, saver: Any, observers: dict, cache: dict) -> list[EncodedTensor]:
    """The saver's tensors for layer ``job`` (probed once per shape, dtype and args)."""
    rows, columns = where.shape
    key = (rows, columns, where.dtype, job.weights, job.inputs)
    if key not in cache:
        args = job.weights
        unit = row_unit(args.block_structure[0] if args.strategy == "block" else None)

        def encode(weight: torch.Tensor) -> dict[str, torch.Tensor]:
            return saver.encode_module("", quantized_layer(weight, job, observers))

        try:
            cache[key] = layer_layout(rows, columns, where.dtype, unit, encode)
        except LayoutError as exc:
            raise LayoutError(f"layer {job.module!r}: {exc}") from None
    return cache[key]


@torch.no_grad()
def _write_layer(out: StreamedFile, source: _Source, where: StoredTensor, job: LayerJob,
                 tensors: list[EncodedTensor], saver: Any, observers: dict) -> None:
    """Quantize and encode layer ``job`` a chunk of rows at a time, each chunk's bytes written as it is made."""
    rows, columns = where.shape
    step = chunk_rows(rows, columns, job, observers)
    whole: dict[str, torch.Tensor] = {}
    for first in range(0, rows, step):
        weight = source.rows(where, first, min(step, rows - first))
        encoded = saver.encode_module("", quantized_layer(weight, job, observers))
        for tensor in tensors:
            name, value = f"{job.module}.{tensor.key}", encoded[tensor.key]
            if tensor.row_split:
                out.write(name, value)
            elif tensor.shape_record:
                if not first:
                    out.write(name, torch.tensor([rows, columns], dtype=value.dtype))
            elif not first:
                whole[tensor.key] = value
                out.write(name, value)
            elif not torch.equal(whole[tensor.key], value):
                raise LayoutError(f"layer {job.module!r}: the saver's {tensor.key!r} differs between chunks of rows; "
                                  f"model-free cannot write it in chunks")
        del encoded, weight
        source.chunks += 1
        if source.chunks % TRIM_EVERY == 0:
            release_freed_memory()


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``; nothing elsewhere).

    Why: a chunk's temporaries are a few MiB each; glibc raises its mmap threshold after such blocks
    are freed, so later ones come from the threads' heaps and stay resident once freed. Measured on
    the bench's FP8_DYNAMIC run (1B-shaped, 2 workers): peak RSS 607-791 MiB without, 422-450 MiB trimming every
    4 chunks (every chunk: the same peak, 30 % slower; after each layer: 479 MiB)
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def layer_amax(path: Path, stored: StoredTensor) -> torch.Tensor:
    """The largest magnitude of a 2-D tensor of ``path`` as float32, read a chunk of rows at a time (NVFP4's
    global scale: a maximum, exact in any order)."""
    source = _Source(path)
    try:
        rows, columns = stored.shape
        step = max(1, CHUNK_ELEMENTS // max(columns, 1))
        amax = torch.zeros((), dtype=torch.float32)
        for first in range(0, rows, step):
            amax = torch.maximum(amax, source.rows(stored, first, min(step, rows - first)).abs().amax().float())
        return amax
    finally:
        source.close()


def _peak_rss() -> int:
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def default_threads(workers: int) -> int:
    """Torch threads per worker: the machine's cores shared out."""
    return max(1, (os.cpu_count() or 1) // max(workers, 1))
