"""NVFP4 global scales, shared by the projections an inference server fuses into one matrix.

vLLM loads q/k/v (and gate/up) into one fused matrix with one global scale: it keeps a single
scale for the fused weight, so checkpoints whose q, k and v global scales differ decode wrongly
(or are refused). Layers that fuse therefore take the global scale of their largest magnitude
together (:func:`weight_global_scale` of them all), and every other layer its own.

Which projections fuse is named by leaf name: :data:`FUSED_PROJECTIONS` for every model, plus the sets a model
patch declares (``ModelPatch.fused_projections``) for names the table does not know (:func:`fused_sets`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

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


def fused_sets(declared: Sequence[Sequence[str]] = ()) -> tuple[tuple[str, ...], ...]:
    """The sets that fuse for a model whose patch declares ``declared``: those, then :data:`FUSED_PROJECTIONS`.

    Added to the table, not instead of it: a patch naming its attention's ``wq/wk/wv`` keeps gate/up fused,
    and a set shared that the server does not fuse costs precision only, while one not shared that it does
    fuse decodes wrongly. A leaf name in a declared set takes that set, before the table's."""
    return (*(tuple(members) for members in declared), *FUSED_PROJECTIONS)


def fused_groups(names: list[str], fused: Sequence[Sequence[str]] = FUSED_PROJECTIONS) -> list[list[str]]:
    """``names`` (qualified module names) grouped into the sets a server fuses (``fused``: leaf-name sets, the
    first one naming a leaf is its set; :func:`fused_sets` gives a patch's): siblings under one parent module
    whose leaves are in one set share a group, any other name is alone."""
    groups: dict[tuple[str, int], list[str]] = defaultdict(list)
    order: list[tuple[str, int]] = []
    for name in names:
        parent, _, leaf = name.rpartition(".")
        kind = next((i for i, members in enumerate(fused) if leaf in members), None)
        key = (parent, kind) if kind is not None else (name, -1)
        if key not in groups:
            order.append(key)
        groups[key].append(name)
    return [groups[key] for key in order]


def global_scales(weights: Mapping[str, Tensor], args: QuantizationArgs,
                  fused: Sequence[Sequence[str]] = FUSED_PROJECTIONS) -> dict[str, Tensor]:
    """Each weight's NVFP4 global scale (``(out, in)`` weights by module name), equal within a fused set
    (:func:`fused_groups` with ``fused``); empty for formats without one."""
    if args.float_format != "nvfp4":
        return {}
    scales: dict[str, Tensor] = {}
    for group in fused_groups(list(weights), fused):
        scale = weight_global_scale([weights[name] for name in group], args)
        scales.update(dict.fromkeys(group, scale))
    return scales
