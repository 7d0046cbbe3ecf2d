"""DeepSeek-V3 (MLA attention, shared + routed experts, grouped top-k routing): one decoder layer
at a time, routed experts as per-expert Linear layers, every expert calibrated on every token
(see :mod:`layerwise.model_zoo.moe`). The shared experts and the first dense layers are plain
Linear MLPs and are calibrated as usual; the router's correction bias is left alone."""

from __future__ import annotations

from layerwise import hookimpl

from .moe import text_moe_patch

DEEPSEEK_V3 = text_moe_patch("deepseek_v3", "DeepSeek-V3", "deepseek_v3", "DeepseekV3", tiny_sizes=dict(
    random_routers=True, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, rope_interleave=False))


@hookimpl
def layerwise_register_model_patches(register):
    register(DEEPSEEK_V3)
