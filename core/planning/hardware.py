"""What a GPU can do, for planning a run or its serving on a machine that is not this one.

The table holds vendor datasheet numbers (dense, no sparsity; read 2026-11-26). Time estimates
take :data:`EFFICIENCY` of the peak; a device that is present is measured instead
(:func:`measured_rates`), which is what a plan on the machine that will run says.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

#: share of a datasheet peak a calibration run reaches (launch overheads, memory-bound steps)
EFFICIENCY = 0.4


@dataclass(frozen=True)
class GPU:
    """One GPU model: compute capability, memory, and dense peak rates in TFLOP/s."""

    name: str
    capability: tuple[int, int]
    memory_gib: float
    half_tflops: float  # bf16 (fp16 on Turing) tensor cores, dense
    fp32_tflops: float  # plain fp32 (GPTQ's solves and Hessians run in float32)


#: datasheet numbers (NVIDIA product pages / whitepapers), dense; names matched case-insensitively
GPUS: tuple[GPU, ...] = (
    GPU("T4", (7, 5), 16, 65, 8.1),
    GPU("A10", (8, 6), 24, 125, 31.2),
    GPU("A100", (8, 0), 80, 312, 19.5),
    GPU("A100-40GB", (8, 0), 40, 312, 19.5),
    GPU("L4", (8, 9), 24, 121, 30.3),
    GPU("L40S", (8, 9), 48, 362, 91.6),
    GPU("RTX4090", (8, 9), 24, 165, 82.6),
    GPU("H100", (9, 0), 80, 989, 67),
    GPU("H200", (9, 0), 141, 989, 67),
    GPU("B200", (10, 0), 180, 2250, 80),
    GPU("RTX5090", (12, 0), 32, 209, 104.8),
)


def find_gpu(name: str) -> GPU:
    """The table's GPU called ``name`` (``h100``, ``NVIDIA H100 80GB HBM3``, ``rtx-4090``); an unknown name
    lists the known ones."""
    from layerwise.errors import UnknownNameError

    key = gpu_key(name)
    for gpu in GPUS:
        if gpu_key(gpu.name) == key:
            return gpu
    # a device name as torch reports it: the longest table name it contains
    contained = [gpu for gpu in GPUS if gpu_key(gpu.name) in key]
    if contained:
        return max(contained, key=lambda gpu: len(gpu.name))
    raise UnknownNameError("GPU", name, [gpu.name for gpu in GPUS])


def gpu_key(name: str) -> str:
    """A GPU name compared without case, punctuation or the vendor's words."""
    return "".join(ch for ch in name.lower() if ch.isalnum()).replace("nvidia", "").replace("geforce", "")


@dataclass(frozen=True)
class Rates:
    """Matmul rates (FLOP/s) used for a time estimate, and where they come from."""

    model_dtype: float
    fp32: float
    source: str


def table_rates(gpu: GPU) -> Rates:
    """Rates from the table, at :data:`EFFICIENCY` of the datasheet peak."""
    return Rates(gpu.half_tflops * 1e12 * EFFICIENCY, gpu.fp32_tflops * 1e12 * EFFICIENCY,
                 f"{gpu.name} datasheet x {EFFICIENCY:.0%} (an estimate)")


def measured_rates(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.15) -> Rates:
    """Matmul rates measured on ``device`` now (a square ``size`` product in ``dtype`` and in float32)."""
    return Rates(matmul_rate(device, dtype, size, seconds / 2), matmul_rate(device, torch.float32, size, seconds / 2),
                 f"measured now on {device} ({dtype} and float32 {size}x{size} matmuls)")


def matmul_rate(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.075) -> float:
    """FLOP/s of a square ``size`` product in ``dtype`` on ``device``, measured now over about ``seconds``."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b  # warm-up
    _sync(device)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or count < 2:
        a @ b
        count += 1
    _sync(device)
    return 2 * size ** 3 * count / (time.perf_counter() - start)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def present_gpu(device: torch.device) -> GPU | None:
    """The table's entry for the GPU ``device`` is, when it is a CUDA device here (else ``None``)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    try:
        return find_gpu(name)
    except Exception:  # noqa: BLE001 - a GPU the table does not know: its capability is still asked
        major, minor = torch.cuda.get_device_capability(device)
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        return GPU(name, (major, minor), total, 0.0, 0.0)
