"""The public plugin API: every name a third-party plugin needs, and a promise that they stay.

A pipeline, modifier, observer, dataset loader, saver or model patch imports from here (and
from ``layerwise`` itself) only; the rest of layerwise is private and free to change. The
names below, and those of the submodules, keep their meaning within a minor release series
(0.1.x); a change is announced in the changelog one minor release ahead, with the old name kept
working (and warning) for that release.

- ``layerwise.plugin``: the hooks and the contracts (this module);
- :mod:`layerwise.plugin.quantization`: schemes, the quantization math, how a quantized weight
  is stored on its module, the solvers (GPTQ, AWQ, SmoothQuant) and smoothing mappings;
- :mod:`layerwise.plugin.sparsity`: mask structures and scores, how a pruned weight is marked,
  the SparseGPT solver, bitmask encoders;
- :mod:`layerwise.plugin.calibration`: statistics gathered from data (Hessians, finite checks),
  merging them across data-parallel ranks, and time accounting;
- :mod:`layerwise.plugin.pipelines`: what a pipeline runs on (cache, offload, tracing, guards);
- :mod:`layerwise.plugin.saving`: writing an output folder safely, and the :class:`Saver` contract;
- :mod:`layerwise.plugin.data`: the dataset-loader contract and the keys a batch holds.
"""

from layerwise.common.matching import (
    DEFAULT_IGNORE,
    IgnoreWarning,
    block_entries,
    find_modules,
    has_weight,
    inside_pattern,
    layers_within,
    matches,
    unmatched,
    warn_block_ignore,
    warn_unmatched_ignore,
)
from layerwise.common.user_warnings import AlgorithmFallbackWarning, warn_user
from layerwise.errors import (
    DatasetError,
    InvalidArgumentError,
    LayerwiseError,
    NonFiniteError,
    RecipeError,
    RecipeNameError,
    UnknownNameError,
    check_choice,
    did_you_mean,
    unknown_names,
)
from layerwise.host.hookspecs import hookimpl
from layerwise.host.lifecycle import Lifecycle
from layerwise.host.model_patch import ModelPatch
from layerwise.host.modifier import SESSION_FIELDS, ForeignField, Modifier
from layerwise.host.modifier_fields import ForeignFieldWarning
from layerwise.host.patch_selection import applied_patch, apply_patch, find_patch
from layerwise.host.pipeline import Pipeline, PipelineFailed, PipelineOptions
from layerwise.host.plugin_manager import get_host, registry
from layerwise.host.state import CompressionState
from layerwise.host.versions import TESTED_TRANSFORMERS
from layerwise.tracing import LazyFunctions, opaque

__all__ = [
    "DEFAULT_IGNORE",
    "SESSION_FIELDS",
    "TESTED_TRANSFORMERS",
    "AlgorithmFallbackWarning",
    "CompressionState",
    "DatasetError",
    "ForeignField",
    "ForeignFieldWarning",
    "IgnoreWarning",
    "InvalidArgumentError",
    "LayerwiseError",
    "LazyFunctions",
    "Lifecycle",
    "ModelPatch",
    "Modifier",
    "NonFiniteError",
    "Pipeline",
    "PipelineFailed",
    "PipelineOptions",
    "RecipeError",
    "RecipeNameError",
    "UnknownNameError",
    "applied_patch",
    "apply_patch",
    "block_entries",
    "check_choice",
    "did_you_mean",
    "find_modules",
    "find_patch",
    "get_host",
    "has_weight",
    "hookimpl",
    "inside_pattern",
    "layers_within",
    "matches",
    "opaque",
    "registry",
    "unknown_names",
    "unmatched",
    "warn_block_ignore",
    "warn_unmatched_ignore",
    "warn_user",
]
