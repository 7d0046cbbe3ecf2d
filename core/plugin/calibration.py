"""Statistics for plugins: Hessians, finite checks, merging across data-parallel ranks, time accounting."""

from layerwise.algorithms.hessian import (
    GRAM_STRIP,
    HessianError,
    add_gram,
    gram_dtype,
    gram_strip,
    gram_to_hessian,
)
from layerwise.runtime.accounting import Accounting, gptq_solve_flops, gram_flops
from layerwise.runtime.distributed import Reducer, check, is_main, rank, spread, world_size
from layerwise.runtime.finite import NonFiniteSampleWarning, drop_if_non_finite, is_finite, listed

__all__ = [
    "GRAM_STRIP", "Accounting", "HessianError", "NonFiniteSampleWarning", "Reducer", "add_gram", "check",
    "drop_if_non_finite", "gptq_solve_flops", "gram_dtype", "gram_flops", "gram_strip", "gram_to_hessian", "is_finite", "is_main", "listed",
    "rank", "spread", "world_size",
]
