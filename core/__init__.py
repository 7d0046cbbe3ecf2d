"""layerwise: compress transformers models one piece at a time.

The public API is small::

    import layerwise
    model = layerwise.compress("path/to/model", "W4A16", dataset="calib.txt", output_dir="out")

Plugins implement the hooks in :mod:`layerwise.hookspecs`, marked with :data:`hookimpl`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .hookspecs import hookimpl
from .model_patch import ModelPatch
from .modifier import Modifier

__version__ = "0.1.0"

__all__ = ["ModelPatch", "Modifier", "__version__", "compress", "hookimpl", "load_compressed", "load_model", "trace"]

# compress/trace/load_model/load_compressed pull in transformers; import them on first use so
# that `import layerwise` (and plugin discovery) stays cheap.
_LAZY = {"compress": ".compression", "load_compressed": ".compressed_loading", "load_model": ".loading",
         "trace": ".tracing"}

if TYPE_CHECKING:
    from .compressed_loading import load_compressed
    from .compression import compress
    from .loading import load_model
    from .tracing import trace


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module 'layerwise' has no attribute {name!r}")
