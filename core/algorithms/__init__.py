"""The math: quantization, sparsity and the Hessians they share, as plain functions on tensors.

Owns formats' numerics (schemes, grids, packing, bitmasks), the solvers (GPTQ, AWQ's search,
SmoothQuant's scales, SparseGPT, masks) and how a compressed weight is stored on a module.
Takes tensors and modules, returns tensors or raises; no hooks, no I/O, no plugins. May import
only ``layerwise.common`` and ``layerwise.errors``.
"""
