"""Mixtral: one decoder layer at a time, experts as per-expert Linear layers, every expert
calibrated on every token (see :mod:`layerwise.model_zoo.moe`)."""

from __future__ import annotations

from layerwise import hookimpl

from ._rotation import moe_layout
from .moe import moe_smoothing_mappings, text_moe_patch

#: Mixtral's original checkpoints call the expert layers w1 (gate), w3 (up), w2 (down)
_EXPERT_NAMES = ("w1", "w3", "w2")

MIXTRAL = text_moe_patch("mixtral", "Mixtral", "mixtral", "Mixtral",
                         tiny_sizes=dict(head_dim=16, num_local_experts=4, num_experts_per_tok=2),
                         expert_names=_EXPERT_NAMES,
                         smoothing_mappings=moe_smoothing_mappings(("q_proj", "k_proj", "v_proj"), _EXPERT_NAMES),
                         rotation_layout=moe_layout(_EXPERT_NAMES))


@hookimpl
def layerwise_register_model_patches(register):
    register(MIXTRAL)
