"""``simulated_device``: a second device on a CPU-only machine, to catch a tensor left behind.

A pipeline, modifier or solver that calibrates on a GPU moves the weights of one piece, the
cached activations and whatever it builds (masks, positions, scales) to the execution device.
A tensor that stays on the CPU makes the first op that mixes it with the others fail on the GPU
(``Expected all tensors to be on the same device``); on the CPU, where execution device and
home are one, nothing shows. ``simulated_device()`` shows it without a GPU::

    with simulated_device("cuda:0") as gpu:
        layerwise.compress(model, recipe, dataset=samples, device="cuda:0")
    gpu.check_home(model)  # every weight went back to the CPU

Inside the block a :class:`~torch.overrides.TorchFunctionMode` gives every tensor a *logical*
device: a tensor moved to ``cuda:0`` (``.to``, ``.cuda``, a factory with ``device=``, the result
of an op on such tensors, ``param.data = moved``) is a real CPU tensor marked as being on
``cuda:0``, and ``.device`` / ``.is_cuda`` report it so. Every torch call whose tensor arguments
sit on two logical devices raises :class:`DeviceMismatchError` as CUDA would (a zero-dimensional
CPU tensor mixes with anything, as on CUDA; ``copy_`` and indexing with CPU indices are allowed).
The values computed are the CPU's own, so a simulated run's result equals a CPU run's bit for bit.

What it cannot see: code outside torch's Python API (a C++ extension creating its own tensors),
``torch.cuda.*`` calls (the device is not really there: ``torch.cuda.is_available()`` stays
``False``, so code that asks it takes its CPU path) and ``torch.load(map_location=...)`` onto the
simulated device. :func:`layerwise.runtime.devices.resolve_device` accepts the simulated device
while the block runs, and :func:`layerwise.runtime.devices.free_memory` reports ``free_bytes`` for it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from layerwise.common.device_caches import clear_device_caches
from layerwise.runtime import devices as _devices

__all__ = ["DeviceMismatchError", "SimulatedDevice", "simulated_device"]


class DeviceMismatchError(RuntimeError):
    """A torch call mixed tensors on two (logical) devices: on a real second device it would fail."""


_DEVICE = torch.Tensor.device.__get__
#: calls whose tensors may sit on different devices (a copy, indexing with CPU indices, a type query)
_CROSS_DEVICE = {torch.Tensor.copy_, torch.Tensor.__setitem__, torch._has_compatible_shallow_copy_type}


class SimulatedDevice(TorchFunctionMode):
    """The mode behind :func:`simulated_device`; ``moves`` counts the tensors moved each way and ``ops`` the calls."""

    def __init__(self, device: str | torch.device = "cuda:0") -> None:
        super().__init__()
        device = torch.device(device)
        self.device = torch.device(device.type, device.index or 0)
        if self.device.type in ("cpu", "meta"):
            raise ValueError(f"simulate a device other than the CPU (and meta), not {device}")
        self._on: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.moves: Counter[str] = Counter()
        self.moved_bytes: Counter[str] = Counter()
        self.ops = 0

    # -- logical devices ------------------------------------------------------------
    def on_device(self, tensor: torch.Tensor) -> bool:
        """Is ``tensor`` on the simulated device?"""
        return tensor in self._on

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return self.device if tensor in self._on else _DEVICE(tensor)

    def _is_simulated(self, device: Any) -> bool:
        if isinstance(device, int):  # a bare index names an accelerator
            return True
        if device is None:
            return False
        device = torch.device(device)
        return device.type == self.device.type and device.index in (None, self.device.index)

    def _mark(self, tensor: Any, on: bool) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        if on:
            self._on[tensor] = True
        else:
            self._on.pop(tensor, None)

    def check_home(self, model: torch.nn.Module) -> None:
        """Raise :class:`DeviceMismatchError` naming the parameters and buffers of ``model`` left on the device."""
        left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t in self._on]
        if left:
            raise DeviceMismatchError(f"{len(left)} tensor(s) of the model stayed on the simulated {self.device} "
                                      f"after the run: {', '.join(left[:5])}")

    # -- the mode -------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        self.ops += 1
        special = _SPECIAL.get(func)
        if special is not None:
            return special(self, func, args, kwargs)
        if func is torch.Tensor.numpy and self.on_device(args[0]):
            raise DeviceMismatchError(f"numpy() of a tensor on {self.device}: move it to the CPU first")
        return self._call(func, args, kwargs)

    def _call(self, func: Any, args: tuple, kwargs: dict) -> Any:
        target = kwargs.get("device")
        explicit = isinstance(target, (str, torch.device, int))  # not a tracer's proxy of a device
        if explicit and self._is_simulated(target):
            kwargs["device"] = "cpu"
        checked = args[:1] if func is torch.Tensor.__getitem__ else (args, kwargs)  # CPU indices are fine
        tensors = [t for t in tree_flatten(checked)[0] if isinstance(t, torch.Tensor)]
        if func not in _CROSS_DEVICE:
            self._check_one_device(func, tensors)
        out = func(*args, **kwargs)
        on = self._is_simulated(target) if explicit else any(t in self._on for t in tensors)
        if on:
            inputs = {id(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and id(t) not in inputs:
                    self._on[t] = True
        return out

    def _check_one_device(self, func: Any, tensors: list[torch.Tensor]) -> None:
        found: dict[torch.device, torch.Tensor] = {}
        for t in tensors:
            device = self.device_of(t)
            if device.type == "cpu" and t.dim() == 0:  # a CPU scalar mixes with CUDA tensors
                continue
            if device.type == "meta":  # placeholders and shapes: no data to mix
                continue
            found.setdefault(device, t)
        if len(found) > 1:
            shown = ", ".join(f"{tuple(t.shape)} on {d}" for d, t in found.items())
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise DeviceMismatchError(f"Expected all tensors to be on the same device, but {name} got {shown} "
                                      f"(simulated {self.device})")

    def _to(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        first = args[0] if args else kwargs.get("other")
        if isinstance(first, torch.Tensor):  # .to(other): other's logical device and dtype
            target: torch.device | None = self.device_of(first)
            dtype = first.dtype
            non_blocking = bool(args[1]) if len(args) > 1 else kwargs.get("non_blocking", False)
            copy = bool(args[2]) if len(args) > 2 else kwargs.get("copy", False)
            memory_format = kwargs.get("memory_format", torch.preserve_format)
        else:
            copy = kwargs.pop("copy", False)
            target, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
            memory_format = memory_format if memory_format is not None else torch.preserve_format
            if target is not None and target.type == self.device.type and target.index is None:
                target = self.device
            if isinstance(args[0] if args else None, int):
                target = self.device
        source = self.device_of(tensor)
        target = source if target is None else target
        to_simulated = self._is_simulated(target)
        moves = self._is_simulated(source) != to_simulated
        real = None if to_simulated or target.type == _DEVICE(tensor).type else target
        out = tensor.to(device=real, dtype=dtype, non_blocking=non_blocking, copy=copy or moves,
                        memory_format=memory_format)
        if moves:
            way = "to device" if to_simulated else "to cpu"
            self.moves[way] += 1
            self.moved_bytes[way] += out.numel() * out.element_size()
        if out is not tensor:
            self._mark(out, to_simulated)
        return out


def _data_get(mode: SimulatedDevice, func: Any, args: tuple, kwargs: dict) -> Any:
    out = func(*args)
    mode._mark(out, mode.on_device(args[0]))
    return out


def _data_set(mode: SimulatedDevice, func: Any, args: tuple, kwargs: dict) -> None:
    func(*args)
    mode._mark(args[0], mode.on_device(args[1]))


def _pin_memory(mode: SimulatedDevice, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    if mode.on_device(args[0]):
        raise DeviceMismatchError(f"cannot pin a tensor on {mode.device}: only CPU tensors can be pinned")
    return args[0].clone()


def _get_device(mode: SimulatedDevice, func: Any, args: tuple, kwargs: dict) -> int:
    device = mode.device_of(args[0])
    return -1 if device.type == "cpu" else device.index


#: calls the mode answers itself: the device a tensor reports, moves, and page-locked memory (a plain copy here)
_SPECIAL = {
    torch.Tensor.device.__get__: lambda mode, func, args, kwargs: mode.device_of(args[0]),
    torch.Tensor.is_cuda.__get__: lambda mode, func, args, kwargs: mode.device_of(args[0]).type == "cuda",
    torch.Tensor.is_cpu.__get__: lambda mode, func, args, kwargs: mode.device_of(args[0]).type == "cpu",
    torch.Tensor.get_device: _get_device,
    torch.Tensor.data.__get__: _data_get,
    torch.Tensor.data.__set__: _data_set,
    torch.Tensor.to: lambda mode, func, args, kwargs: mode._to(args[0], *args[1:], **kwargs),
    torch.Tensor.cuda: lambda mode, func, args, kwargs: mode._to(
        args[0], mode.device, non_blocking=kwargs.get("non_blocking", False)),
    torch.Tensor.cpu: lambda mode, func, args, kwargs: mode._to(args[0], "cpu"),
    torch.Tensor.pin_memory: _pin_memory,
    torch.Tensor.is_pinned: lambda mode, func, args, kwargs: False,
}


@contextlib.contextmanager
def simulated_device(device: str | torch.device = "cuda:0", free_bytes: int | None = None,
                     default: bool = False) -> Iterator[SimulatedDevice]:
    """Inside the block, ``device`` exists: tensors moved there are tagged, and mixing devices fails.

    ``free_bytes`` is the device memory :func:`layerwise.runtime.devices.free_memory` reports for it
    (``None``: unknown, as for a device that cannot say). With ``default`` it is also where calibration
    runs when no device is named, as a visible GPU is (the test suite's ``LAYERWISE_TEST_DEVICE=simulated``).
    """
    mode = SimulatedDevice(device)
    with _devices.simulating(mode.device, free_bytes, default), _no_graphs(), _fresh_device_caches(), mode:
        yield mode


@contextlib.contextmanager
def _fresh_device_caches() -> Iterator[None]:
    """No cache keyed by the device (:mod:`layerwise.common.device_caches`) hands the simulation an entry made
    before it (on a real GPU, or in another simulation: a CPU tensor it does not count as on the device), or
    keeps one of its CPU tensors under the device's name after it."""
    clear_device_caches()
    try:
        yield
    finally:
        clear_device_caches()


@contextlib.contextmanager
def _no_graphs() -> Iterator[None]:
    """GPTQ's column loop eager: a simulated GPU's tensors live in CPU memory, and on a host with a real GPU
    a CUDA graph recorded on them would launch real kernels on CPU pointers."""
    from layerwise.algorithms.quantization import gptq

    recorder = gptq._graph_backend
    gptq._graph_backend = _Eager
    try:
        yield
    finally:
        gptq._graph_backend = recorder


class _Eager:
    @staticmethod
    def available(device: torch.device) -> bool:
        return False
