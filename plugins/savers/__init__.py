"""Built-in output formats."""

from layerwise.plugin import hookimpl

from .compressed_tensors import save_compressed

__all__ = ["save_compressed"]


@hookimpl
def layerwise_register_savers(register):
    register("compressed-tensors", save_compressed)
