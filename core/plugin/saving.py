"""For saver authors: the Saver contract, writing a folder safely (atomic, never over an input), sizes."""

from layerwise.host.saver import FunctionSaver, Saver
from layerwise.model_io.saving import (
    OWNER_MARK,
    Overwrite,
    atomic_output_dir,
    check_not_an_input,
    check_output_dir,
    run_inputs,
)
from layerwise.runtime.finite import check_saved, skipped_prefixes
from layerwise.runtime.sizes import first_time, parameter_bytes

__all__ = [
    "OWNER_MARK", "FunctionSaver", "Overwrite", "Saver", "atomic_output_dir", "check_not_an_input", "check_output_dir",
    "check_saved", "first_time", "parameter_bytes", "run_inputs", "skipped_prefixes",
]
