"""Writing installed distributions for plugin tests (used by the ``fake_dist`` fixture in conftest.py)."""

from __future__ import annotations

import textwrap
from pathlib import Path


def write_dist(site: Path, name: str, version: str = "1.0", *, entry_points: dict[str, str],
               files: dict[str, str] | None = None) -> Path:
    """Write an installed distribution into ``site`` as pip would, and return its .dist-info.

    ``entry_points`` maps entry-point names of the ``layerwise`` group to their target
    (``"my_pkg"`` or ``"my_pkg.sub:obj"``); ``files`` maps paths under ``site`` to Python
    source (dedented), e.g. ``{"my_pkg/__init__.py": "..."}``.
    """
    for relative, source in (files or {}).items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines = ["[layerwise]", *(f"{ep} = {target}" for ep, target in entry_points.items())]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "RECORD").write_text("")
    return info
