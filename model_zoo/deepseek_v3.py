"""DeepSeek-V3 (MLA attention, shared + routed experts, grouped top-k routing): one decoder layer
at a time, routed experts as per-expert Linear layers, every expert calibrated on every token
(see :mod:`layerwise.model_zoo.moe`). The shared experts and the first dense layers are plain
Linear MLPs and are calibrated as usual; the router's correction bias is left alone."""

from __future__ import annotations

from layerwise import hookimpl

from .moe import text_moe_patch

DEEPSEEK_V3 = text_moe_patch("deepseek_v3", "DeepSeek-V3", "deepseek_v3", "DeepseekV3")


@hookimpl
def layerwise_register_model_patches(register):
    register(DEEPSEEK_V3)
