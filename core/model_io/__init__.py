"""What a run reads and writes: model folders, checkpoints, calibration data, output folders.

Owns loading a model (its task head, its load errors, compressed checkpoints), streaming weights
from safetensors and writing them back piece by piece, turning datasets into batches, and
writing output folders safely (atomic, locked, never over an input). May import
``layerwise.runtime``, ``layerwise.host``, ``layerwise.algorithms``, ``layerwise.common`` and
``layerwise.errors``; never a verb or a plugin.
"""
