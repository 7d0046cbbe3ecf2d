"""Where calibration runs: the device a user asks for, checked before anything loads.

``None`` means the first GPU torch sees (the current one, so that each ``torchrun`` rank keeps
its own), else the CPU. A GPU asked for where torch sees none is an error that says why, never a
silent run on the CPU; so is an index beyond the GPUs there are.
"""

from __future__ import annotations

import torch

from layerwise.errors import InvalidArgumentError, LayerwiseError


class CalibrationOutOfMemoryError(LayerwiseError, MemoryError):
    """The execution device ran out of memory inside a piece; the message lists what lowers the need."""


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The execution device for ``device`` (``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``)."""
    if device is None:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N' (CLI: --device)") from exc
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise InvalidArgumentError(f"device {device!r}: layerwise calibrates on 'cpu' or 'cuda' devices (CLI: --device)")
    if not torch.cuda.is_available():
        build = f"torch {torch.__version__} built without CUDA" if torch.version.cuda is None else \
            "no GPU visible (check the driver and CUDA_VISIBLE_DEVICES)"
        raise InvalidArgumentError(f"device {device!r} asked for, but torch sees no GPU ({build}); "
                                   f"pass device='cpu' (CLI: --device cpu)")
    count = torch.cuda.device_count()
    if resolved.index is not None and resolved.index >= count:
        raise InvalidArgumentError(f"device {device!r} asked for, but torch sees {count} GPU(s): "
                                   f"cuda:0 to cuda:{count - 1}")
    return resolved


def out_of_memory_error(exc: BaseException, device: torch.device, offload: str,
                        targets_per_subgraph: int, streamed: bool) -> CalibrationOutOfMemoryError:
    """What to tell a user whose run ran out of memory: where, and the fixes that apply to this run."""
    fixes = ["fewer tokens per sample (max_seq_length, CLI --max-seq-length)",
             "fewer calibration samples (num_calibration_samples, CLI --num-samples)"]
    if offload != "disk":
        fixes.append("cached activations on disk (offload='disk', CLI --offload disk)")
    if targets_per_subgraph > 1:
        fixes.append("one target per piece (targets_per_subgraph=1, CLI --targets-per-subgraph 1)")
    if not streamed and device.type == "cpu":
        fixes.append("weights read from disk piece by piece (weights='stream', CLI --weights stream)")
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CalibrationOutOfMemoryError(f"out of memory on {device} while calibrating ({first}); nothing was saved. "
                                       f"Try: {'; '.join(fixes)}")
