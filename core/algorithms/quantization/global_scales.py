"""NVFP4 global scales, shared by the projections an inference server fuses into one matrix.

vLLM loads q/k/v (and gate/up) into one fused matrix with one global scale: it keeps a single
scale for the fused weight, so checkpoints whose q, k and v global scales differ decode wrongly
(or are refused). Layers that fuse therefore take the global scale of their largest magnitude
together (:func:`weight_global_scale` of them all), and every other layer its own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from torch import Tensor

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import weight_global_scale

#: sibling projections vLLM fuses (attention's q/k/v, the gated MLP's gate/up; BERT's query/key/value)
FUSED_PROJECTIONS: tuple[tuple[str, ...], ...] = (
    ("q_proj", "k_proj", "v_proj"),
    ("gate_proj", "up_proj"),
    ("query", "key", "value"),
    ("w1", "w3"),
)


def fused_groups(names: list[str]) -> list[list[str]]:
    """``names`` (qualified module names) grouped into the sets a server fuses; any other name alone."""
    groups: dict[tuple[str, int], list[str]] = defaultdict(list)
    order: list[tuple[str, int]] = []
    for name in names:
        parent, _, leaf = name.rpartition(".")
        kind = next((i for i, members in enumerate(FUSED_PROJECTIONS) if leaf in members), None)
        key = (parent, kind) if kind is not None else (name, -1)
        if key not in groups:
            order.append(key)
        groups[key].append(name)
    return [groups[key] for key in order]


def global_scales(weights: Mapping[str, Tensor], args: QuantizationArgs) -> dict[str, Tensor]:
    """Each weight's NVFP4 global scale (``(out, in)`` weights by module name), equal within a fused set;
    empty for formats without one."""
    if args.float_format != "nvfp4":
        return {}
    scales: dict[str, Tensor] = {}
    for group in fused_groups(list(weights)):
        scale = weight_global_scale([weights[name] for name in group], args)
        scales.update(dict.fromkeys(group, scale))
    return scales
