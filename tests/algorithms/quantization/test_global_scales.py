"""NVFP4 global scales over the projections a server fuses: the default table plus a model patch's own sets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import layerwise
from layerwise.algorithms.quantization.float_formats import nvfp4_global_scale
from layerwise.algorithms.quantization.global_scales import (
    FUSED_PROJECTIONS,
    fused_groups,
    fused_sets,
)
from layerwise.host.model_patch import ModelPatch

NAMES = [f"layers.0.self_attn.{p}" for p in ("wq", "wk", "wv", "o_proj")] + [
    f"layers.0.mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")]


def test_a_patch_declared_set_is_added_to_the_default_table():
    assert fused_sets() == FUSED_PROJECTIONS
    declared = fused_sets((("wq", "wk", "wv"),))
    assert declared == (("wq", "wk", "wv"), *FUSED_PROJECTIONS)
    assert fused_groups(NAMES, declared) == [NAMES[:3], [NAMES[3]], NAMES[4:6], [NAMES[6]]]
    # without the declaration wq/wk/wv are three layers of their own; gate/up still fuse
    assert fused_groups(NAMES) == [[NAMES[0]], [NAMES[1]], [NAMES[2]], [NAMES[3]], NAMES[4:6], [NAMES[6]]]
    # siblings fuse under one parent only
    assert fused_groups(["a.wq", "b.wk"], declared) == [["a.wq"], ["b.wk"]]


def test_a_declared_leaf_takes_its_set_before_the_table():
    names = [f"attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]
    assert fused_groups(names, fused_sets((("q_proj", "k_proj"),))) == [names[:2], names[2:]]


@pytest.mark.parametrize("bad", [("wq", "wk"), (("self_attn.wq", "self_attn.wk"),), (("wq", "wk"), ("wk", "wv")),
                                 (("wq", ""),)])
def test_fused_projections_must_be_distinct_leaf_names(bad):
    with pytest.raises(ValueError, match="fused_projections must be tuples of distinct leaf module names"):
        ModelPatch(name="bad", fused_projections=bad)


def _global_scales(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return {name.removesuffix(".weight_global_scale"): t for name, t in tensors.items()
            if name.endswith(".weight_global_scale")}


def test_the_in_memory_run_shares_the_global_scale_its_patch_declares(register_plugin, tmp_path):
    from tests.wq_llama import WqPlugin, build_wq_llama

    attention = [f"model.layers.{i}.self_attn.{p}" for i in (0, 1) for p in ("wq", "wk", "wv")]
    source = {name: build_wq_llama().get_submodule(name).weight.float() for name in attention}
    own = {name: nvfp4_global_scale(weight.abs().amax()) for name, weight in source.items()}
    layerwise.compress(build_wq_llama(), "NVFP4A16", output_dir=tmp_path / "alone", show_progress=False)
    alone = _global_scales(tmp_path / "alone")
    assert all(torch.equal(alone[name], own[name].reshape(1)) for name in attention)
    assert len({alone[name].item() for name in attention[:3]}) == 3  # scaled apart: three different scales

    register_plugin(WqPlugin(), "wq-llama")
    model = layerwise.compress(build_wq_llama(), "NVFP4A16", output_dir=tmp_path / "fused", show_progress=False)
    assert model.layerwise_report.pipeline == "datafree"
    fused = _global_scales(tmp_path / "fused")
    for layer in (attention[:3], attention[3:]):
        shared = nvfp4_global_scale(torch.stack([source[name].abs().amax() for name in layer]).amax())
        assert all(torch.equal(fused[name], shared.reshape(1)) for name in layer)
    # the default table still holds: gate/up share, o_proj and down_proj keep their own
    assert torch.equal(fused["model.layers.0.mlp.gate_proj"], fused["model.layers.0.mlp.up_proj"])
    assert torch.equal(fused["model.layers.0.self_attn.o_proj"], alone["model.layers.0.self_attn.o_proj"])
    assert torch.equal(fused["model.layers.0.mlp.down_proj"], alone["model.layers.0.mlp.down_proj"])
