"""The zoo's fused projections beyond the default table: NVFP4 gives each set one global scale, as vLLM loads it."""

from __future__ import annotations

import torch
from zoo_tiny_models import ARCHS

import layerwise
from layerwise.algorithms.quantization.float_formats import nvfp4_global_scale


def test_deepseek_v3_shares_the_mla_down_projections_global_scale():
    torch.manual_seed(0)
    model = ARCHS["deepseek_v3"].build()
    attention = model.model.layers[0].self_attn
    fused = ("q_a_proj", "kv_a_proj_with_mqa")  # vLLM's fused_qkv_a_proj
    amax = {name: getattr(attention, name).weight.detach().abs().amax() for name in (*fused, "q_b_proj")}
    assert nvfp4_global_scale(amax[fused[0]]) != nvfp4_global_scale(amax[fused[1]])
    layerwise.compress(model, "NVFP4A16", show_progress=False)
    shared = nvfp4_global_scale(torch.stack([amax[name] for name in fused]).amax()).reshape(1)
    assert all(torch.equal(getattr(attention, name).weight_global_scale, shared) for name in fused)
    assert torch.equal(attention.q_b_proj.weight_global_scale, nvfp4_global_scale(amax["q_b_proj"]).reshape(1))
