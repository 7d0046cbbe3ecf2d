"""One shard of a model-free run: its layers quantized one tensor at a time, the rest copied as bytes.

What is quantized goes through the very steps a data-free in-memory run takes (the recipe's
observer, :func:`~layerwise.algorithms.quantization.qmath.weight_qparams`,
:func:`~layerwise.algorithms.quantization.storage.set_quantized_weight`, dynamic input
quantization) on a bare ``nn.Linear`` holding the tensor as stored, then the registered saver's
``encode_module`` writes it: the bytes an in-memory run saves (``tests/model_io/model_free``
compares them). Memory: one source tensor (read with ``safe_open``), its float32 work, and the
shard's encoded outputs until the shard file is written; every other tensor is copied from the
source file to the output file in chunks.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import weight_qparams
from layerwise.algorithms.quantization.storage import set_input_quantization, set_quantized_weight
from layerwise.model_io.streaming.safetensors_io import StoredTensor, read_header, write_file


@dataclass(frozen=True)
class LayerJob:
    """How one layer is quantized (its module name, weight args, input args)."""

    module: str
    weights: QuantizationArgs
    inputs: QuantizationArgs | None


@dataclass(frozen=True)
class ShardJob:
    """One source shard, where its output goes, its layers to quantize, and the saver's name."""

    source: Path
    target: Path
    layers: tuple[LayerJob, ...]
    save_format: str
    threads: int


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


@torch.no_grad()
def quantized_layer(weight: torch.Tensor, job: LayerJob, observers: dict[QuantizationArgs, object]) -> nn.Linear:
    """``weight`` quantized as a data-free ``QuantizationModifier`` quantizes a layer, on a bare Linear."""
    module = linear_holding(weight)
    observer = observers.get(job.weights)
    if observer is None:
        from layerwise.host.plugin_manager import registry

        observer = observers[job.weights] = registry("observers").get(job.weights.observer)(job.weights)
    work = weight.detach().to(torch.float32)
    scale, zero_point = weight_qparams(work, job.weights, observer)
    set_quantized_weight(module, work, scale, zero_point, job.weights)
    if job.inputs is not None:
        set_input_quantization(module, job.inputs)  # dynamic only: a model-free recipe has no data
    return module


def run_shard(job: ShardJob) -> ShardResult:
    """Quantize the layers of ``job.source`` and write ``job.target`` (complete or absent)."""
    from safetensors import safe_open

    from layerwise.host.plugin_manager import registry

    start = time.perf_counter()
    if job.threads and torch.get_num_threads() > job.threads:
        torch.set_num_threads(job.threads)  # process-wide: the workers share the cores
    saver = registry("savers").get(job.save_format)
    stored = read_header(job.source)
    by_tensor = {f"{layer.module}.weight": layer for layer in job.layers}
    observers: dict[QuantizationArgs, object] = {}
    out: dict[str, torch.Tensor | StoredTensor] = {}
    with safe_open(str(job.source), framework="pt") as handle:
        for name, where in stored.items():
            layer = by_tensor.get(name)
            if layer is None:
                out[name] = where  # copied byte for byte
                continue
            module = quantized_layer(handle.get_tensor(name), layer, observers)
            for key, tensor in saver.encode_module("", module).items():
                out[f"{layer.module}.{key}"] = tensor
            del module
    nbytes = write_file(job.target, out)
    return ShardResult(job.target.name, tuple(out), nbytes, time.perf_counter() - start, _peak_rss())


def _peak_rss() -> int:
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def default_threads(workers: int) -> int:
    """Torch threads per worker: the machine's cores shared out."""
    return max(1, (os.cpu_count() or 1) // max(workers, 1))
