"""For saver authors: writing an output folder safely (atomic, never over an input), finite checks."""

from layerwise.model_io.saving import (
    OWNER_MARK,
    Overwrite,
    atomic_output_dir,
    check_not_an_input,
    check_output_dir,
    run_inputs,
)
from layerwise.runtime.finite import check_saved, skipped_prefixes

__all__ = [
    "OWNER_MARK", "Overwrite", "atomic_output_dir", "check_not_an_input", "check_output_dir", "check_saved",
    "run_inputs", "skipped_prefixes",
]
