"""For pipeline authors: the contract, the activations cache, offloading, tracing and guards."""

from layerwise.host.pipeline import (
    Pipeline,
    PipelineFailed,
    PipelineOptions,
    blocks_reason,
    inputs_are_held,
    inputs_held_unchanged,
)
from layerwise.host.pipeline_selection import PipelineAborted, run_pipeline
from layerwise.runtime.cache import IntermediatesCache, move_to
from layerwise.runtime.devices import (
    DeviceErrorWarning,
    canonical,
    device_error_note,
    is_device_error,
)
from layerwise.runtime.heap import keep_temporaries_in_heap
from layerwise.runtime.offload import ModuleOffloader
from layerwise.runtime.placement import (
    WORKING_SET_FACTOR,
    Placement,
    plan_placement,
    working_set_bytes,
)
from layerwise.tracing import trace
from layerwise.tracing.result import output_difference
from layerwise.tracing.retrace import TracesByGuards
from layerwise.tracing.targets import TargetError, default_targets

__all__ = [
    "WORKING_SET_FACTOR", "DeviceErrorWarning", "IntermediatesCache", "ModuleOffloader", "Pipeline", "PipelineAborted", "PipelineFailed", "PipelineOptions", "Placement",
    "TargetError", "TracesByGuards", "blocks_reason", "canonical", "default_targets", "device_error_note", "inputs_are_held", "inputs_held_unchanged",
    "is_device_error", "keep_temporaries_in_heap", "move_to", "output_difference", "plan_placement", "run_pipeline", "trace", "working_set_bytes",
]
