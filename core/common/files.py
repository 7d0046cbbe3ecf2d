"""Writing one file whole or not at all, and naming the file when the operating system refuses a write."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

#: the errnos of a write the disk has no room for (no space left, the user's quota spent)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class FileWriteError(OSError):
    """An ``OSError`` from writing ``filename``, with the bytes that file was to hold (``nbytes``; ``None``:
    unknown). A write on an open file (``os.pwrite``, ``file.write``) fails naming neither, and "the disk is
    full" is fixed faster knowing which folder filled and how much it needed."""

    def __init__(self, refused: OSError, path: str | os.PathLike, nbytes: int | None = None) -> None:
        super().__init__(refused.errno, refused.strerror, str(path))
        self.nbytes = nbytes


@contextlib.contextmanager
def naming_the_file(path: str | os.PathLike, nbytes: int | None = None) -> Iterator[None]:
    """Inside, an ``OSError`` that names no file becomes a :class:`FileWriteError` naming ``path`` (and
    ``nbytes``); one naming its file already, or carrying no errno (a message of ours), passes unchanged."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno is None:
            raise
        raise FileWriteError(exc, path, nbytes) from exc


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is the operating system saying the disk (or the quota) has no room left."""
    return isinstance(exc, OSError) and exc.errno in DISK_FULL


def size_text(nbytes: int) -> str:
    """``1.50 GiB``, ``12.0 MiB``, ``800 bytes``: a size as an error message gives it."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes} bytes"


def write_through(path: str | os.PathLike, write: Callable[[BinaryIO], object], nbytes: int | None = None) -> None:
    """``write(handle)`` into a new file at ``path``, as ``torch.save(value, handle)``: a refused write is a
    :class:`FileWriteError` naming the file, and no part of the file stays behind to hold the disk.

    ``torch.save`` reports a refused write as an opaque ``RuntimeError`` (``unexpected pos``): given a path, with
    no errno at all; given a handle, with the handle's ``OSError`` as its context, which is raised instead.
    """
    try:
        with open(path, "wb") as handle:
            write(handle)
    except BaseException as exc:
        Path(path).unlink(missing_ok=True)
        refused = _refused_write(exc)
        if refused is None or (refused is exc and exc.filename is not None):
            raise
        raise FileWriteError(refused, path, nbytes) from exc


def _refused_write(exc: BaseException) -> OSError | None:
    """The operating system's error behind ``exc`` (itself, or what it was raised while handling), if any."""
    seen: BaseException | None = exc
    for _ in range(8):  # a short chain: the writer's error, then what its clean-up raised
        if seen is None:
            return None
        if isinstance(seen, OSError) and seen.errno is not None:
            return seen
        seen = seen.__context__
    return None


def replace_file(path: Path, content: str | bytes) -> None:
    """Write ``content`` to a temporary file beside ``path``, then rename it over ``path``: a reader, or a run
    interrupted meanwhile, sees the old file or the new one, never a part of it. A refused write names ``path``."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = content if isinstance(content, bytes) else content.encode("utf-8")
    try:
        with naming_the_file(path, len(data)):
            temporary.write_bytes(data)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
