"""Tracing a model into per-target subgraphs (torch.fx, meta shapes, autowrap, robust mode).

    from layerwise.tracing import trace
    result = trace(model, {"input_ids": ids, "attention_mask": mask})
    for sub in result.subgraphs: values.update(sub.run(values))
"""

from __future__ import annotations

from .api import trace
from .autowrap import WrappedStatement
from .guards import Guard, GuardViolation
from .opaque import LazyFunctions, opaque
from .partition import OUTPUT_NAME, Subgraph
from .result import OpaqueCall, SwallowedTargetsError, TraceError, TraceResult, VerifyError
from .targets import TargetError

__all__ = [
    "OUTPUT_NAME", "Guard", "GuardViolation", "LazyFunctions", "OpaqueCall", "Subgraph", "SwallowedTargetsError", "TargetError", "TraceError", "TraceResult",
    "VerifyError", "WrappedStatement", "opaque", "trace",
]
