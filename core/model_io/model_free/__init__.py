"""Model-free compression: data-free schemes applied shard by shard straight from safetensors files.

No model class is built (the architecture may be one transformers does not know): layers are
tensors selected by name and shape, quantized with the functions a data-free run uses and
encoded by the registered saver, one shard per worker thread. See :mod:`.run`.
"""

from layerwise.model_io.model_free.run import ModelFreeError, compress_model_free

__all__ = ["ModelFreeError", "compress_model_free"]
