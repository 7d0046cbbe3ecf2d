"""Built-in output formats."""

from layerwise.plugin import hookimpl

from .compressed_tensors import CompressedTensorsSaver, save_compressed

__all__ = ["CompressedTensorsSaver", "save_compressed"]


@hookimpl
def layerwise_register_savers(register):
    register("compressed-tensors", CompressedTensorsSaver())
