"""The one error type of ``layerwise new-patch``: bad input, named with its fix."""

from __future__ import annotations

from ..errors import LayerwiseError


class ScaffoldError(LayerwiseError, ValueError):
    """An architecture (or name) the scaffold cannot generate a package for, and what to do instead."""
