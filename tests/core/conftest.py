"""Fixtures for tests/core: ``fake_dist`` writes a real installed distribution for plugin tests."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from layerwise.plugin_manager import reset_host
from tests.core.fake_dists import write_dist


@pytest.fixture
def fake_dist(tmp_path, monkeypatch) -> Iterator[Callable[..., Path]]:
    """``fake_dist(name, version="1.0", entry_points={...}, files={...})`` installs a distribution.

    The distributions live in one folder put at the front of ``sys.path``; the plugin host
    is reset after each call (the next ``get_host()`` discovers them) and after the test,
    and the modules they hold are forgotten.
    """
    site = tmp_path / "site-packages"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    top_level: set[str] = set()

    def install(name: str, version: str = "1.0", *, entry_points: dict[str, str],
                files: dict[str, str] | None = None) -> Path:
        top_level.update(Path(relative).parts[0].removesuffix(".py") for relative in files or {})
        info = write_dist(site, name, version, entry_points=entry_points, files=files)
        importlib.invalidate_caches()
        reset_host()
        return info

    yield install
    for module in [m for m in sys.modules if m.split(".")[0] in top_level]:
        del sys.modules[module]
    reset_host()
