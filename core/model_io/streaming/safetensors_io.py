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

import json
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

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


def write_file(path: Path, tensors: dict[str, torch.Tensor | StoredTensor],
               written: Callable[[torch.Tensor], None] | None = None) -> int:
    """Write ``tensors`` (CPU tensors, or byte ranges of another safetensors file copied unchanged) to ``path``
    atomically; returns the data bytes written. ``written`` is told each chunk of a tensor once it is
    in the file (to release mapped pages as it goes)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, value in tensors.items():
        if isinstance(value, StoredTensor):
            dtype, shape, nbytes = value.dtype, list(value.shape), value.nbytes
        else:
            dtype, shape, nbytes = NAMES[value.dtype], list(value.shape), value.numel() * value.element_size()
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for value in tensors.values():
            if isinstance(value, StoredTensor):
                _copy_range(value, out)
            elif value.numel():
                data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                for begin in range(0, data.numel(), _COPY_CHUNK):
                    chunk = data[begin:begin + _COPY_CHUNK]
                    out.write(memoryview(chunk.numpy()))
                    if written is not None:
                        written(chunk)
    os.replace(tmp, path)
    return offset


def _copy_range(stored: StoredTensor, out) -> None:
    with open(stored.path, "rb") as source:
        source.seek(stored.start)
        left = stored.nbytes
        while left:
            chunk = source.read(min(left, _COPY_CHUNK))
            if not chunk:
                raise OSError(f"{stored.path} ended before its tensor's bytes")
            out.write(chunk)
            left -= len(chunk)
