"""The saver's error, shared by its modules (quantized and sparse weights)."""

from __future__ import annotations

from layerwise.plugin import LayerwiseError


class SaveError(LayerwiseError):
    """A model that cannot be written in the compressed-tensors format."""
