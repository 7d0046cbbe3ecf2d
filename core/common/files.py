"""Writing one file whole or not at all."""

from __future__ import annotations

import os
from pathlib import Path


def replace_file(path: Path, content: str | bytes) -> None:
    """Write ``content`` to a temporary file beside ``path``, then rename it over ``path``: a reader, or a run
    interrupted meanwhile, sees the old file or the new one, never a part of it."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        if isinstance(content, bytes):
            temporary.write_bytes(content)
        else:
            temporary.write_text(content, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
