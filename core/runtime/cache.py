"""The intermediates cache: each calibration batch's named values between subgraphs.

Values rest on an *offload device* (CPU by default, or files on disk when the
activations of every calibration sample do not fit in RAM) and are moved to the
*execution device* when a subgraph fetches them. With a ``device_budget`` (bytes), values
produced on the execution device stay there while the budget lasts (nothing to copy either
way); beyond it they spill to the offload device: on CUDA into pinned (page-locked) CPU memory
with asynchronous copies, which a later fetch copies back asynchronously too (the copies are
ordered on the stream; nothing on the host reads them in between). Values may be nested tuples,
lists, dicts, dataclasses (``ModelOutput`` included) or ``None``; tensors anywhere
inside are moved, everything else is kept as is. :meth:`IntermediatesCache.free`
drops values after their last consumer, so the cache never holds more than the
boundary between two pieces of the model. A value held in memory that equals the one stored last under
its name (rotary cos/sin, position ids, masks: the same for every window of one length) is kept once,
shared by the batches (on tiny-llama-doc's 128 windows, 32 MB of cos/sin held once instead of 128 times).

Example::

    with IntermediatesCache(offload="disk") as cache:
        cache.update(0, {"hidden": h})
        values = cache.fetch(0, ["hidden"])      # on the execution device
        cache.free(["hidden"])
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from layerwise.common.files import is_disk_full, size_text, write_through
from layerwise.common.processes import owner_record
from layerwise.errors import DiskFullError
from layerwise.runtime.devices import canonical
from layerwise.runtime.heap import FreedBytes

__all__ = ["IntermediatesCache", "move_to", "remove_stale_caches", "tensor_bytes"]

_DEVICE_KINDS = ("cpu", "disk")
#: a disk cache's folder is ``layerwise-cache-<pid>-XXXX`` in the temporary (or offload) folder
CACHE_PREFIX = "layerwise-cache-"
#: inside a disk cache: the owner process (:func:`~layerwise.common.processes.owner_record`)
OWNER_FILE = ".owner"


def remove_stale_caches(folder: str | os.PathLike) -> list[str]:
    """Remove disk caches left in ``folder`` by processes that no longer run; their paths.

    A run killed by a signal cannot clean up after itself (finally and atexit do not run),
    and its cache may be as large as every calibration sample's activations; the next
    run that makes a cache removes it, telling its owner by the cache's :data:`OWNER_FILE` (or,
    for a cache without one, the PID in the name). A cache another machine or container writes
    (an offload folder on a shared file system) is never removed.
    """
    from layerwise.common.processes import owner_state, read_owner_record

    removed = []
    for entry in os.scandir(folder):
        pid = entry.name[len(CACHE_PREFIX):].split("-")[0]
        if not (entry.name.startswith(CACHE_PREFIX) and pid.isdigit() and entry.is_dir()):
            continue
        try:
            owner, where = read_owner_record(Path(entry.path, OWNER_FILE).read_text())
        except OSError:
            owner, where = int(pid), {}
        if owner is not None and owner_state(owner, where) == "dead":
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def _map_tensors(value: Any, fn: Any) -> Any:
    """Rebuild ``value`` with ``fn`` applied to every tensor inside it."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if value is None or isinstance(value, (str, bytes, int, float, bool, torch.device, torch.dtype)):
        return value
    # ModelOutput is an OrderedDict *and* a dataclass holding only its non-None fields
    if _is_model_output(value):
        return type(value)(**{k: _map_tensors(v, fn) for k, v in value.items()})
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        init = {f.name: _map_tensors(getattr(value, f.name), fn) for f in dataclasses.fields(value) if f.init}
        rebuilt = type(value)(**init)
        for f in dataclasses.fields(value):
            if not f.init:
                setattr(rebuilt, f.name, _map_tensors(getattr(value, f.name), fn))
        return rebuilt
    if isinstance(value, tuple):
        items = [_map_tensors(v, fn) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, list):
        return [_map_tensors(v, fn) for v in value]
    if isinstance(value, Mapping):
        items = {k: _map_tensors(v, fn) for k, v in value.items()}
        return items if type(value) is dict else type(value)(items)
    return value


def _is_model_output(value: Any) -> bool:
    try:
        from transformers.utils import ModelOutput
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(value, ModelOutput)


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    _map_tensors(value, lambda t: found.append(t) or t)
    return found


def move_to(value: Any, device: torch.device | str | None, non_blocking: bool = False) -> Any:
    """``value`` with every tensor inside it on ``device`` (``None``: unchanged); ``non_blocking`` copies from
    pinned memory (or to a GPU) asynchronously."""
    if device is None:
        return value
    device = torch.device(device)
    return _map_tensors(value, lambda t: t if t.device == device else t.to(device, non_blocking=non_blocking))


def _to_host(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` in CPU memory (``device``): from CUDA into pinned memory, copied asynchronously."""
    if tensor.device == device:
        return tensor
    if tensor.device.type == "cuda" and device.type == "cpu" and torch.cuda.is_available():
        host = torch.empty_like(tensor, device="cpu", pin_memory=True)
        return host.copy_(tensor, non_blocking=True)
    return tensor.to(device)


def tensor_bytes(value: Any, device_type: str | None = None) -> int:
    """Bytes held by the distinct tensor storages inside ``value`` (only those on ``device_type``, if given)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in _tensors(value):
        if device_type is not None and t.device.type != device_type:
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key in seen and storage.data_ptr() != 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


@dataclasses.dataclass
class _OnDisk:
    path: str
    nbytes: int


class IntermediatesCache:
    """Per-batch named values, offloaded between subgraphs.

    ``offload`` is ``"cpu"`` (default), ``"disk"`` (each value ``torch.save``-d to a
    temporary folder under ``offload_dir`` and loaded only when fetched) or a device.
    ``execution_device`` is where :meth:`fetch` puts tensors (``None``: where they rest).
    Use it as a context manager, or call :meth:`close`, to remove disk files; they are
    removed at interpreter exit too, and by the next disk cache if this process was killed.
    """

    def __init__(self, offload: str | torch.device = "cpu", execution_device: torch.device | str | None = None,
                 offload_dir: str | os.PathLike | None = None, device_budget: int = 0) -> None:
        self.disk = isinstance(offload, str) and offload == "disk"
        if self.disk:
            self.offload_device = torch.device("cpu")
        else:
            try:
                self.offload_device = torch.device(offload)
            except (RuntimeError, TypeError):
                raise ValueError(f"offload must be 'cpu', 'disk' or a torch device, got {offload!r}") from None
        self.execution_device = canonical(execution_device)
        #: bytes of values kept on the execution device (a CPU execution device keeps nothing apart)
        self.device_budget = device_budget if self._apart() else 0
        self._on_device = 0  # bytes of values held on the execution device
        #: values spilled to the offload device (or disk) because the device budget was spent
        self.spilled = 0
        self._values: dict[int, dict[str, Any]] = {}
        self._freed = FreedBytes()  # freed values' memory goes back to the system, not only to the heap
        self._held = 0  # bytes of the values held in memory (for the trim's step)
        #: per name, the value stored last in memory (a later equal value shares it) ...
        self._last: dict[str, Any] = {}
        #: ... and how many (batch, name) entries hold each stored value, by id (freed with the last)
        self._uses: dict[int, int] = {}
        #: the most bytes of values held in memory at once, host and execution device (what a plan forecasts)
        self.peak_bytes = 0
        self._dir: str | None = None
        self._offload_dir = offload_dir
        self._counter = 0
        if self.disk:
            if offload_dir is not None:
                os.makedirs(offload_dir, exist_ok=True)
            self._dir = tempfile.mkdtemp(prefix=f"{CACHE_PREFIX}{os.getpid()}-", dir=offload_dir)
            Path(self._dir, OWNER_FILE).write_text(owner_record())
            remove_stale_caches(os.path.dirname(self._dir))
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)

    # -- writing ---------------------------------------------------------------------
    def _apart(self) -> bool:
        """Is the execution device another than where values rest (a GPU)?"""
        return self.execution_device is not None and self.execution_device.type not in ("cpu", "meta")

    def _device_bytes(self, value: Any) -> int:
        return tensor_bytes(value, device_type=self.execution_device.type) if self._apart() else 0

    def put(self, batch: int, name: str, value: Any) -> None:
        """Store ``value`` as ``name`` of ``batch`` (replacing an older value of that name)."""
        self._drop(batch, name)
        on_device = self._device_bytes(value) if self.device_budget else 0
        if on_device and self._on_device + on_device <= self.device_budget and \
                all(t.device == self.execution_device for t in _tensors(value)):
            self._on_device += on_device  # it stays where it was computed
            self._values.setdefault(batch, {})[name] = value
            self.peak_bytes = max(self.peak_bytes, self._held + self._on_device)
            return
        if on_device:
            self.spilled += 1
        if self.disk:
            assert self._dir is not None
            self._counter += 1
            path = os.path.join(self._dir, f"b{batch}-{self._counter}.pt")
            cpu_value = move_to(value, "cpu")
            self._save(cpu_value, path)
            stored: Any = _OnDisk(path, os.path.getsize(path))
        else:
            stored = self._equal_to_last(name, value)
            if stored is None:
                stored = _map_tensors(value, lambda t: _to_host(t, self.offload_device))
                self._held += tensor_bytes(stored, device_type="cpu")
                self.peak_bytes = max(self.peak_bytes, self._held + self._on_device)
            self._last[name] = stored
            self._uses[id(stored)] = self._uses.get(id(stored), 0) + 1
        self._values.setdefault(batch, {})[name] = stored

    def _equal_to_last(self, name: str, value: Any) -> Any:
        """The value stored last under ``name`` if ``value`` is equal to it: a tensor or a tuple / list of
        tensors, already on the offload device, the same dtypes, shapes and elements (a differing tensor
        fails at its first differing element, so hidden states cost microseconds here)."""
        last = self._last.get(name)
        if last is None or type(last) is not type(value):
            return None
        pairs = [(value, last)] if isinstance(value, torch.Tensor) else \
            list(zip(value, last)) if type(value) in (tuple, list) and len(value) == len(last) else []
        if pairs and all(isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)
                         and new.device == old.device == self.offload_device and new.dtype == old.dtype
                         and new.shape == old.shape and torch.equal(new, old) for new, old in pairs):
            return last
        return None

    def _save(self, value: Any, path: str) -> None:
        """``value`` to the cache file ``path``; a full disk is a :class:`~layerwise.errors.DiskFullError` saying
        where the cache is and where else it can go, and leaves no part of the file."""
        nbytes = tensor_bytes(value)
        try:
            write_through(path, lambda handle: torch.save(value, handle), nbytes)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            raise DiskFullError(
                f"the disk cache of activations (offload='disk') in '{self._dir}' ran out of room "
                f"({exc.strerror}): it held {size_text(self.disk_bytes())} and needed {size_text(nbytes)} more. "
                f"Fix: free space on that disk, {self._elsewhere()}, or keep the activations in memory "
                f"(offload='cpu', CLI: --offload cpu) if they fit") from exc

    def _elsewhere(self) -> str:
        """How to put the cache on another disk: the folder it was given, else the temporary folder (``TMPDIR``)."""
        if self._offload_dir is not None:
            return f"or pass an offload_dir on a disk with room (now '{self._offload_dir}')"
        return (f"or put the cache on a disk with room: it goes to the temporary folder ('{tempfile.gettempdir()}'), "
                f"so set TMPDIR to a folder on another disk")

    def update(self, batch: int, values: Mapping[str, Any]) -> None:
        """Store several named values of one batch."""
        for name, value in values.items():
            self.put(batch, name, value)

    # -- reading ---------------------------------------------------------------------
    def get(self, batch: int, name: str) -> Any:
        """One value, its tensors on the execution device."""
        try:
            stored = self._values[batch][name]
        except KeyError:
            held = sorted(self._values.get(batch, {}))
            raise KeyError(f"the cache holds no value {name!r} for batch {batch} (it holds {held}); "
                           "was it freed before its last consumer?") from None
        if isinstance(stored, _OnDisk):  # read into CPU memory, then moved like any value held there
            return move_to(torch.load(stored.path, map_location="cpu", weights_only=False), self.execution_device)
        return move_to(stored, self.execution_device, non_blocking=self._apart())

    def fetch(self, batch: int, names: Iterable[str] | None = None) -> dict[str, Any]:
        """Named values of one batch (all of them when ``names`` is ``None``)."""
        names = list(self._values.get(batch, {})) if names is None else list(names)
        return {name: self.get(batch, name) for name in names}

    def names(self, batch: int = 0) -> list[str]:
        return list(self._values.get(batch, {}))

    @property
    def num_batches(self) -> int:
        return len(self._values)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, tuple) and len(key) == 2:
            batch, name = key
            return name in self._values.get(batch, {})  # type: ignore[operator]
        return False

    def rename(self, old: str, new: str) -> None:
        """Every batch's ``old`` value becomes its ``new`` value (replacing it); nothing is copied."""
        for batch, values in self._values.items():
            if old in values:
                self._drop(batch, new)
                values[new] = values.pop(old)
        self._last.pop(old, None)  # what is stored under new from now on is not known here: share nothing
        self._last.pop(new, None)

    # -- freeing ---------------------------------------------------------------------
    def free(self, names: Iterable[str], batch: int | None = None) -> None:
        """Drop ``names`` from every batch (or from one ``batch``); their disk files too."""
        names = list(names)
        batches = list(self._values) if batch is None else [batch]
        for b in batches:
            for name in names:
                self._drop(b, name)

    def _drop(self, batch: int, name: str) -> None:
        stored = self._values.get(batch, {}).pop(name, None)
        if isinstance(stored, _OnDisk):
            try:
                os.remove(stored.path)
            except FileNotFoundError:
                pass
        elif stored is not None:
            uses = self._uses.pop(id(stored), 1) - 1
            if uses:  # another batch shares it
                self._uses[id(stored)] = uses
                return
            if self._last.get(name) is stored:
                del self._last[name]
            self._on_device = max(0, self._on_device - self._device_bytes(stored))
            freed = tensor_bytes(stored, device_type="cpu")
            self._held = max(0, self._held - freed)
            self._freed.add(freed, self._held)

    def clear(self) -> None:
        for batch, values in list(self._values.items()):
            for name in list(values):
                self._drop(batch, name)
        self._values.clear()
        self._last.clear()
        self._uses.clear()
        self._freed.flush()

    def close(self) -> None:
        """Drop everything and remove the disk folder."""
        self.clear()
        if self._dir is not None:
            self._finalizer()
            self._dir = None

    def __enter__(self) -> IntermediatesCache:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- accounting ------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Bytes of tensor storage the cache holds in memory (each storage counted once)."""
        in_memory = [v for values in self._values.values() for v in values.values() if not isinstance(v, _OnDisk)]
        return tensor_bytes(in_memory)

    def disk_bytes(self) -> int:
        """Bytes of the cache's files on disk."""
        return sum(v.nbytes for values in self._values.values() for v in values.values() if isinstance(v, _OnDisk))

    def size_bytes(self) -> int:
        """Everything the cache holds: memory plus disk."""
        return self.memory_bytes() + self.disk_bytes()

    @property
    def directory(self) -> str | None:
        """The temporary folder of a disk cache (``None`` otherwise or once closed)."""
        return self._dir

    def __repr__(self) -> str:
        where = f"disk:{self._dir}" if self.disk else str(self.offload_device)
        return (f"IntermediatesCache(batches={self.num_batches}, offload={where}, "
                f"execution_device={self.execution_device}, bytes={self.size_bytes()}, "
                f"on_device={self._on_device}/{self.device_budget})")

    @property
    def device_bytes(self) -> int:
        """Bytes of the values kept on the execution device (within :attr:`device_budget`)."""
        return self._on_device
