"""Running the plugin kit on a freshly generated package, before anything is installed.

The package's module is imported from its file under a private name (so an installed
copy of the same package is neither used nor replaced), its registration hook is called
the way the plugin host calls it, and :func:`layerwise.testing.check_model_patch` runs on
every tiny model the patch lists.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from layerwise.common.quiet import without_progress_bars
from layerwise.host.model_patch import ModelPatch


@dataclass(frozen=True)
class KitResult:
    """What the kit said about the generated patch: ``error`` is empty when it passed."""

    patch: str
    #: the tiny-model builders checked, by name
    models: tuple[str, ...]
    seconds: float
    error: str = ""

    @property
    def passed(self) -> bool:
        return not self.error


def load_generated(package_dir: Path, module: str) -> ModuleType:
    """Import ``src/<module>/__init__.py`` of ``package_dir`` under a private name, without installing it."""
    init = package_dir / "src" / module / "__init__.py"
    private = f"_layerwise_new_patch_{module}"
    spec = importlib.util.spec_from_file_location(private, init, submodule_search_locations=[str(init.parent)])
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {init}")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[private] = loaded
    try:
        spec.loader.exec_module(loaded)
    finally:
        del sys.modules[private]
    return loaded


def registered_patches(module: ModuleType) -> list[ModelPatch]:
    """The patches ``module``'s ``layerwise_register_model_patches`` hook registers."""
    found: list[ModelPatch] = []
    hook = getattr(module, "layerwise_register_model_patches", None)
    if hook is not None:
        hook(found.append)
    return found


def run_kit(package_dir: Path, module: str) -> KitResult:
    """Import the generated package and run ``check_model_patch`` on each of its patches' tiny models."""
    with without_progress_bars():
        return _run_kit(package_dir, module)


def _run_kit(package_dir: Path, module: str) -> KitResult:
    from ..testing import PluginCheckError, check_model_patch

    start = time.perf_counter()
    patches = registered_patches(load_generated(package_dir, module))
    checked: list[str] = []
    for patch in patches:
        for build in patch.tiny_models:
            checked.append(build.__name__)
            try:
                model = build()
            except Exception as error:  # noqa: BLE001 - the author's edit broke the builder: report it like the kit
                return KitResult(patch.name, tuple(checked), time.perf_counter() - start,
                                 f"{build.__name__}() failed: {type(error).__name__}: {error}")
            try:
                check_model_patch(patch, model)
            except PluginCheckError as error:
                return KitResult(patch.name, tuple(checked), time.perf_counter() - start, str(error))
            except Exception as error:  # noqa: BLE001 - mostly the tiny model's own forward failing on the inputs
                return KitResult(patch.name, tuple(checked), time.perf_counter() - start,
                                 f"check_model_patch({patch.name}) raised {type(error).__name__}: {error}. The tiny "
                                 f"model may not run on the sample inputs: check TINY_CONFIG and sample_inputs")
    name = ", ".join(p.name for p in patches) or "(none registered)"
    error = "" if checked else f"{module} registers no model patch with tiny_models to check"
    return KitResult(name, tuple(checked), time.perf_counter() - start, error)
