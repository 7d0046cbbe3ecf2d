"""Where calibration runs: the device a user asks for, checked before anything loads.

``None`` means the first GPU torch sees (the current one, so that each ``torchrun`` rank keeps
its own), else the CPU. A GPU asked for where torch sees none is an error that says why, never a
silent run on the CPU; so is an index beyond the GPUs there are. A GPU always comes back with its
index (``cuda:0``, never ``cuda``): that is what a tensor on it reports, so ``tensor.device ==
device`` means "already there".

A test may simulate a device on the CPU (:func:`layerwise.testing.simulated_device`); while it
does, :func:`resolve_device` accepts that device and :func:`free_memory` reports its budget.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from layerwise.errors import InvalidArgumentError, LayerwiseError


class CalibrationOutOfMemoryError(LayerwiseError, MemoryError):
    """The execution device ran out of memory inside a piece; the message lists what lowers the need."""


class DeviceErrorWarning(RuntimeWarning):
    """A run changed course (another cut, another pipeline) because a tensor sat on the wrong device.

    That is a bug of layerwise, a model patch or a plugin, never a property of the model: the same
    recipe on the CPU took the other course, so the two runs' results differ.
    """


#: what torch says when one op gets tensors on two devices (CUDA, the simulated device, meta)
_DEVICE_ERRORS = ("Expected all tensors to be on the same device", "different from other tensors on",
                  "Expected object of device type", "is on the wrong device", "must be on the same device")


def is_device_error(exc: BaseException | None) -> bool:
    """Is ``exc``, or an error that caused it, a tensor on the wrong device?"""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if any(text in str(exc) for text in _DEVICE_ERRORS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def device_error_note(what: str) -> str:
    """The sentence a warning about a device error ends with."""
    return (f"{what} failed because a tensor was on the wrong device: that is a bug (of layerwise, the model "
            f"patch or a plugin), not a property of the model, and the same recipe takes another course on the "
            f"CPU, so the results differ. Please report it with this message")


def canonical(device: torch.device | str | None) -> torch.device | None:
    """``device`` with its index where it has one (``cuda`` -> ``cuda:0``, the current GPU), as a tensor on it
    reports it: ``tensor.device == canonical(device)`` means "already there"."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cpu" or device.index is not None:
        return device
    simulated = _simulated_match(device)
    if simulated is not None:
        return simulated
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The execution device for ``device`` (``None``, ``"cpu"``, ``"cuda"``, ``"cuda:N"``); a GPU with its index."""
    if device is None:
        if _SIMULATED_DEFAULT:
            return _SIMULATED_DEFAULT[-1]
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgumentError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N' (CLI: --device)") from exc
    if resolved.type == "cpu":
        return resolved
    simulated = _simulated_match(resolved)
    if simulated is not None:
        return simulated
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
    return resolved if resolved.index is not None else torch.device("cuda", torch.cuda.current_device())


#: devices simulated on the CPU by a test, and the free memory each reports (``None``: unknown)
_SIMULATED: dict[torch.device, int | None] = {}
#: simulated devices that are the default (``device=None``), as a visible GPU is; the innermost last
_SIMULATED_DEFAULT: list[torch.device] = []


@contextlib.contextmanager
def simulating(device: torch.device, free_bytes: int | None = None, default: bool = False) -> Iterator[None]:
    """While the block runs, ``device`` (with its index) counts as present, with ``free_bytes`` free
    (and, with ``default``, is what ``device=None`` means)."""
    _SIMULATED[device] = free_bytes
    if default:
        _SIMULATED_DEFAULT.append(device)
    try:
        yield
    finally:
        _SIMULATED.pop(device, None)
        if default:
            _SIMULATED_DEFAULT.remove(device)


def _simulated_match(device: torch.device) -> torch.device | None:
    for simulated in _SIMULATED:
        if simulated.type == device.type and device.index in (None, simulated.index):
            return simulated
    return None


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device`` for calibration, or ``None`` where that is not known (the CPU: the weights'
    home shares it, so nothing is moved to save it)."""
    simulated = _simulated_match(device)
    if simulated is not None:
        return _SIMULATED[simulated]
    if device.type == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return None


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
