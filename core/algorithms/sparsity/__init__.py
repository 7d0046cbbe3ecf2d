"""Weight sparsity: mask structures and selection (:mod:`.masks`), the SparseGPT solver, storage on modules."""

from layerwise.algorithms.sparsity.masks import (
    MaskStructure,
    magnitude_mask,
    parse_mask_structure,
    score_mask,
)
from layerwise.algorithms.sparsity.storage import (
    SPARSITY_ATTR,
    mark_sparse,
    sparse_modules,
    sparsity_of,
)

__all__ = [
    "SPARSITY_ATTR", "MaskStructure", "magnitude_mask", "mark_sparse", "parse_mask_structure", "score_mask",
    "sparse_modules", "sparsity_of",
]
