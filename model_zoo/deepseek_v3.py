"""DeepSeek-V3 (MLA attention, shared + routed experts, grouped top-k routing): one decoder layer
at a time, routed experts as per-expert Linear layers, every expert calibrated on every token
(see :mod:`layerwise.model_zoo.moe`). The shared experts and the first dense layers are plain
Linear MLPs and are calibrated as usual; the router's correction bias is left alone."""

from __future__ import annotations

import dataclasses

from layerwise import hookimpl

from ._rotation import moe_layout
from .moe import moe_smoothing_mappings, text_moe_patch

DEEPSEEK_V3 = text_moe_patch("deepseek_v3", "DeepSeek-V3", "deepseek_v3", "DeepseekV3", tiny_sizes=dict(
    random_routers=True, moe_intermediate_size=32, first_k_dense_replace=1, n_routed_experts=4, n_shared_experts=1,
    num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
    qk_nope_head_dim=8, v_head_dim=16, rope_interleave=False),
    # MLA: input_layernorm feeds the query (q_a_proj, or q_proj without a query LoRA) and the compressed
    # key/value projection; inside, q_a_layernorm feeds q_b_proj and kv_a_layernorm feeds kv_b_proj. No v_proj.
    smoothing_mappings=(
        *moe_smoothing_mappings(("(q_a_proj|q_proj)", "kv_a_proj_with_mqa"), v_to_o=False),
        (("re:.*self_attn\\.q_b_proj",), "re:.*self_attn\\.q_a_layernorm"),
        (("re:.*self_attn\\.kv_b_proj",), "re:.*self_attn\\.kv_a_layernorm"),
    ),
    # MLA's values come out of kv_b_proj beside the keys' no-position part: no v_proj to take a per-head Hadamard
    rotation_layout=moe_layout(attention_inputs=("(q_a_proj|q_proj)", "kv_a_proj_with_mqa"), heads=False))
#: vLLM loads MLA's query and compressed key/value down-projections as one matrix (``fused_qkv_a_proj``, when
#: there is a query LoRA): they share one NVFP4 global scale (the MLPs' gate/up are in the default table)
DEEPSEEK_V3 = dataclasses.replace(
    DEEPSEEK_V3, fused_projections=(("q_a_proj", "kv_a_proj_with_mqa"),),
    kv_cache_refusal="MLA attention caches one compressed latent per token (kv_a_proj_with_mqa's output, "
                     "shared by every head), not per-head keys and values, so there are no k_scale / v_scale to "
                     "calibrate; layerwise does not support an FP8 MLA KV cache: leave kv_cache_scheme out (and "
                     "the CLI's --kv-cache)")


@hookimpl
def layerwise_register_model_patches(register):
    register(DEEPSEEK_V3)
