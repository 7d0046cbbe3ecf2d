"""Qwen3-MoE: one decoder layer at a time, experts as per-expert Linear layers, every expert
calibrated on every token (see :mod:`layerwise.model_zoo.moe`)."""

from __future__ import annotations

from layerwise import hookimpl

from ._rotation import moe_layout
from .moe import moe_smoothing_mappings, text_moe_patch

QWEN3_MOE = text_moe_patch("qwen3_moe", "Qwen3-MoE", "qwen3_moe", "Qwen3Moe", tiny_sizes=dict(
    head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True),
    smoothing_mappings=moe_smoothing_mappings(("q_proj", "k_proj", "v_proj")), rotation_layout=moe_layout())


@hookimpl
def layerwise_register_model_patches(register):
    register(QWEN3_MOE)
