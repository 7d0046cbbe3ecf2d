"""The safetensors layout, read memory-mapped and written a tensor at a time.

Why not the ``safetensors`` package here: its ``get_tensor`` copies each tensor out of the file
and ``save_file`` builds every tensor's bytes in memory before writing. A streamed run reads
weights as copy-on-write views of the file (only the pages a piece touches become resident,
e.g. the embedding rows of the calibration tokens) and writes tensors, or byte ranges of
the source checkpoint copied as they are, straight to the output file.

Layout: 8 bytes little-endian header length, the JSON header (``name -> {dtype, shape,
data_offsets}`` plus ``__metadata__``), then the data.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Self

import torch

from layerwise.common.files import naming_the_file

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
_COPY_CHUNK = 64 * 2**20


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in a safetensors file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsError(ValueError):
    """A file that is not a whole safetensors file (truncated, or its header unreadable)."""


def read_header(path: Path) -> dict[str, StoredTensor]:
    """Where each tensor of ``path`` is; :class:`SafetensorsError` for a truncated or corrupt file."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > size - 8:
                raise ValueError(f"header length {length} exceeds the file")
            header = json.loads(handle.read(length))
        base = 8 + length
        stored = {name: StoredTensor(path, info["dtype"], tuple(info["shape"]), base + info["data_offsets"][0],
                                     info["data_offsets"][1] - info["data_offsets"][0])
                  for name, info in header.items() if name != "__metadata__"}
    except (ValueError, KeyError, TypeError, IndexError, struct.error, UnicodeDecodeError) as exc:
        raise SafetensorsError(f"'{path.name}' is truncated or corrupt: its header cannot be read ({exc})") from exc
    end = max((t.start + t.nbytes for t in stored.values()), default=0)
    if end > size:
        raise SafetensorsError(f"'{path.name}' is truncated or corrupt: its tensors need {end} bytes, the file has "
                               f"{size} (an interrupted download?)")
    return stored


class MappedFiles:
    """One copy-on-write memory map per file, opened on first use.

    :meth:`release` gives the pages of a view back to the system once its values are no longer
    needed (written out, or copied to the GPU): without it every page a run ever read would stay
    resident until the end.
    """

    def __init__(self) -> None:
        self._maps: dict[Path, mmap.mmap] = {}
        self._bases: dict[Path, int] = {}

    def tensor(self, stored: StoredTensor) -> torch.Tensor:
        """A view of ``stored``'s bytes; writing to it copies the page (the file never changes)."""
        if stored.dtype not in DTYPES:
            raise ValueError(f"safetensors dtype {stored.dtype} is not supported for streaming")
        dtype = DTYPES[stored.dtype]
        count = stored.nbytes // torch.empty((), dtype=dtype).element_size()
        if count == 0:
            return torch.empty(stored.shape, dtype=dtype)
        if stored.path not in self._maps:
            with open(stored.path, "rb") as handle:
                mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            self._maps[stored.path] = mapped
            self._bases[stored.path] = torch.frombuffer(mapped, dtype=torch.uint8, count=1).data_ptr()
        flat = torch.frombuffer(self._maps[stored.path], dtype=dtype, count=count, offset=stored.start)
        return flat.view(stored.shape)

    def release(self, tensor: torch.Tensor) -> None:
        """Drop the resident pages lying wholly inside ``tensor`` when it views a map (else nothing).

        Pages it shares with a neighbouring tensor stay: the neighbour may hold changes (copy-on-write)
        that are not written yet. The view reads the file's values again afterwards.
        """
        if tensor.device.type != "cpu" or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        for path, base in self._bases.items():
            mapped = self._maps[path]
            if base <= start and start + nbytes <= base + len(mapped):
                page = mmap.PAGESIZE
                first = -(-(start - base) // page) * page
                last = (start - base + nbytes) // page * page
                if last > first:
                    mapped.madvise(mmap.MADV_DONTNEED, first, last - first)
                return

    def close(self) -> None:
        self._maps.clear()  # tensors still viewing a map keep it alive
        self._bases.clear()


@dataclass(frozen=True)
class TensorLayout:
    """One tensor of a file to write: its safetensors dtype name and shape."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=DTYPES[self.dtype]).element_size()


def layout_of(value: torch.Tensor | StoredTensor) -> TensorLayout:
    """The layout a CPU tensor, or a tensor of another safetensors file copied as it is, is written with."""
    if isinstance(value, StoredTensor):
        return TensorLayout(value.dtype, tuple(value.shape))
    return TensorLayout(NAMES[value.dtype], tuple(value.shape))


@functools.cache
def _dtype_rank() -> dict[str, int]:
    """Where each dtype's tensors go in a file written by the ``safetensors`` package: it orders tensors by
    dtype (its own enum, widest first), then by name. Asked of the package itself (one empty tensor per dtype,
    serialized in memory), so the order follows the installed version."""
    from safetensors.torch import save

    data = save({name: torch.empty(0, dtype=dtype) for name, dtype in DTYPES.items()})
    (length,) = struct.unpack("<Q", data[:8])
    return {name: rank for rank, name in enumerate(k for k in json.loads(data[8:8 + length]) if k != "__metadata__")}


def canonical_order(layout: dict[str, TensorLayout]) -> list[str]:
    """The tensors of ``layout`` in the order ``safetensors.torch.save_file`` writes them: a file written here
    from the same tensors is then the same bytes as the package's (the in-memory saver's)."""
    rank = _dtype_rank()
    return sorted(layout, key=lambda name: (rank.get(layout[name].dtype, len(rank)), name))


class StreamedFile:
    """A safetensors file written header first, then each tensor's bytes as they come, chunk by chunk.

    Why: a file's header names every tensor with its byte range, so a writer that waits for the header
    holds every tensor until the last is made. Here the layout is declared up front (dtypes and shapes
    are known before the values are), the header is written at once, and a tensor's bytes go to their
    place as soon as they exist: one chunk in memory, not a file's worth. The file is built under a
    temporary name and renamed by :meth:`finish` only when every byte of every tensor was written
    (else :meth:`abort`, or leaving the ``with`` block on an error, removes it): complete or absent.
    """

    def __init__(self, path: Path, layout: dict[str, TensorLayout]) -> None:
        self.path = path
        self.layout = {name: layout[name] for name in canonical_order(layout)}
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        self._start: dict[str, int] = {}
        for name, entry in self.layout.items():
            nbytes = entry.nbytes
            header[name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [offset, offset + nbytes]}
            self._start[name] = offset
            offset += nbytes
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.nbytes = offset
        self._base = 8 + len(encoded)
        self._done = dict.fromkeys(self.layout, 0)
        self._tmp = path.with_name(f".{path.name}.tmp")
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with self._named():
                _pwrite_all(self._fd, struct.pack("<Q", len(encoded)) + encoded, 0)
                os.ftruncate(self._fd, self._base + offset)
        except BaseException:
            self.abort()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.finish()
        else:
            self.abort()

    def write(self, name: str, chunk: torch.Tensor) -> None:
        """Append ``chunk`` (the tensor, or its next rows) to tensor ``name``'s bytes."""
        entry = self.layout[name]
        if NAMES.get(chunk.dtype) != entry.dtype:
            raise SafetensorsError(f"tensor {name!r} is declared {entry.dtype}, a chunk of it is {chunk.dtype}")
        data = chunk.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        done = self._done[name]
        if done + data.numel() > entry.nbytes:
            raise SafetensorsError(f"tensor {name!r} is declared {tuple(entry.shape)} ({entry.nbytes} bytes); "
                                   f"{done + data.numel()} bytes were written to it")
        if data.numel():
            with self._named():
                _pwrite_all(self._fd, memoryview(data.numpy()), self._base + self._start[name] + done)
        self._done[name] = done + data.numel()

    def copy(self, name: str, stored: StoredTensor) -> None:
        """Tensor ``name`` as ``stored`` holds it in another safetensors file, copied by the kernel
        (``copy_file_range``: the bytes never pass through this process's memory)."""
        entry = self.layout[name]
        if stored.nbytes != entry.nbytes or self._done[name]:
            raise SafetensorsError(f"tensor {name!r}: {stored.nbytes} bytes to copy into a {entry.nbytes}-byte "
                                   f"slot that has {self._done[name]} already")
        with open(stored.path, "rb") as source, self._named():
            _copy_between(source.fileno(), stored.start, self._fd, self._base + self._start[name], stored.nbytes)
        self._done[name] = stored.nbytes

    def _named(self) -> contextlib.AbstractContextManager:
        """A refused write names this file and its size (a write on a descriptor names neither): a full disk
        then says which folder filled and how much the file needed."""
        return naming_the_file(self.path, self._base + self.nbytes)

    def finish(self) -> int:
        """Check that every tensor is complete and give the file its name; returns the data bytes."""
        short = [name for name, entry in self.layout.items() if self._done[name] != entry.nbytes]
        if short:
            self.abort()
            raise SafetensorsError(f"{self.path.name}: tensor(s) {', '.join(map(repr, short[:5]))} were not written "
                                   f"in full; the file was removed")
        os.close(self._fd)
        self._fd = -1
        os.replace(self._tmp, self.path)
        return self.nbytes

    def abort(self) -> None:
        """Remove the unfinished file."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self._tmp.unlink(missing_ok=True)


def _pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.pwrite(fd, view[:_COPY_CHUNK], offset)
        view, offset = view[written:], offset + written


def _copy_between(source: int, source_offset: int, target: int, target_offset: int, nbytes: int) -> None:
    """``nbytes`` from ``source`` at ``source_offset`` to ``target`` at ``target_offset``: in the kernel where the
    system can (``copy_file_range``), else through a bounded buffer."""
    left = nbytes
    if hasattr(os, "copy_file_range"):
        try:
            while left:
                copied = os.copy_file_range(source, target, min(left, _COPY_CHUNK), source_offset, target_offset)
                if copied == 0:
                    raise OSError(f"the source ended {left} bytes before its tensor's end")
                left, source_offset, target_offset = left - copied, source_offset + copied, target_offset + copied
            return
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                raise
    while left:
        chunk = os.pread(source, min(left, _COPY_CHUNK), source_offset)
        if not chunk:
            raise OSError(f"the source ended {left} bytes before its tensor's end")
        _pwrite_all(target, chunk, target_offset)
        left, source_offset, target_offset = left - len(chunk), source_offset + len(chunk), target_offset + len(chunk)


def write_file(path: Path, tensors: dict[str, torch.Tensor | StoredTensor],
               written: Callable[[torch.Tensor], None] | None = None) -> int:
    """Write ``tensors`` (CPU tensors, or byte ranges of another safetensors file copied unchanged) to ``path``
    atomically; returns the data bytes written. ``written`` is told each chunk of a tensor once it is
    in the file (to release mapped pages as it goes)."""
    with StreamedFile(path, {name: layout_of(value) for name, value in tensors.items()}) as out:
        for name, value in tensors.items():
            if isinstance(value, StoredTensor):
                out.copy(name, value)
            elif value.numel():
                flat = value.detach().to("cpu").contiguous().reshape(-1)
                step = max(1, _COPY_CHUNK // flat.element_size())
                for begin in range(0, flat.numel(), step):
                    chunk = flat[begin:begin + step]
                    out.write(name, chunk)
                    if written is not None:
                        written(chunk.view(torch.uint8))
    return out.nbytes
