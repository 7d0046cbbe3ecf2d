"""Sparsity for plugins: mask structures and scores, marking a pruned weight, SparseGPT, bitmask layouts."""

from layerwise.algorithms.sparsity.bitmask import (
    BITMASK,
    ENCODERS,
    SPARSE_24,
    SparseFormatError,
    encoded_bytes,
)
from layerwise.algorithms.sparsity.masks import (
    MaskStructure,
    check_sparsity,
    magnitude_mask,
    parse_mask_structure,
    score_mask,
)
from layerwise.algorithms.sparsity.sparsegpt import sparsegpt_prune
from layerwise.algorithms.sparsity.storage import (
    PRUNED_ONLY_KEY,
    SPARSITY_ATTR,
    mark_sparse,
    pruned_mask,
    sparse_modules,
)

__all__ = [
    "BITMASK", "ENCODERS", "PRUNED_ONLY_KEY", "SPARSE_24", "SPARSITY_ATTR", "MaskStructure", "SparseFormatError", "check_sparsity",
    "encoded_bytes", "magnitude_mask", "mark_sparse", "parse_mask_structure", "pruned_mask", "score_mask",
    "sparse_modules", "sparsegpt_prune",
]
