"""layerwise: compress transformers models one piece at a time.

The public API is small::

    import layerwise
    model = layerwise.compress("path/to/model", "W4A16", dataset="calib.txt", output_dir="out")

Plugins implement the hooks in :mod:`layerwise.host.hookspecs`, marked with :data:`hookimpl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from layerwise.common import moved_modules
from layerwise.host.hookspecs import hookimpl
from layerwise.host.model_patch import ModelPatch
from layerwise.host.modifier import Modifier

__version__ = "0.1.0"

moved_modules.install()  # scripts importing a module by its old path keep working, warned

__all__ = ["CalibrationOptions", "CompressOptions", "ModelPatch", "Modifier", "OutputOptions", "PlacementOptions",
           "SafetyOptions", "__version__", "compress", "evaluate", "hookimpl", "load_compressed", "load_model", "plan",
           "trace"]

# compress/evaluate/trace/load_model/load_compressed pull in transformers; import them on first use so
# that `import layerwise` (and plugin discovery) stays cheap.
_OPTIONS = ("CalibrationOptions", "CompressOptions", "OutputOptions", "PlacementOptions", "SafetyOptions")
_LAZY = {"compress": ".verbs.compression", "evaluate": ".verbs.evaluation", "load_compressed": ".model_io.compressed_loading",
         "load_model": ".model_io.loading", "plan": ".verbs.plan", "trace": ".tracing", **dict.fromkeys(_OPTIONS, ".verbs.options")}

if TYPE_CHECKING:
    from layerwise.model_io.compressed_loading import load_compressed
    from layerwise.model_io.loading import load_model
    from layerwise.verbs.compression import compress
    from layerwise.verbs.evaluation import evaluate
    from layerwise.verbs.options import (
        CalibrationOptions,
        CompressOptions,
        OutputOptions,
        PlacementOptions,
        SafetyOptions,
    )
    from layerwise.verbs.plan import plan

    from .tracing import trace


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'layerwise' has no attribute {name!r}")
