"""Fused MoE experts split into per-expert 2-D weights by name and byte range (:mod:`~layerwise.model_io.model_free.
experts`), and left dense, with a note, where no model patch declares the split."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import layerwise
from layerwise.host.model_patch import ModelPatch
from layerwise.model_io.model_free import compress_model_free
from layerwise.model_io.model_free.experts import FusedExpertsError, split_experts
from layerwise.model_io.model_free.worker import _Source
from layerwise.model_io.streaming.safetensors_io import read_header
from tests.model_io.model_free.test_model_free import _tensors
from tests.model_io.model_free.test_zoo_model_free import save_fused
from tests.model_zoo.zoo_tiny_models import ARCHS

NAMES = ("wg", "wu", "wd")


def test_a_fused_tensor_splits_into_each_experts_gate_rows_then_up_rows_and_down(tmp_path):
    experts, inter, hidden = 3, 2, 5
    gate_up = torch.arange(experts * 2 * inter * hidden, dtype=torch.bfloat16).reshape(experts, 2 * inter, hidden)
    down = -torch.arange(experts * hidden * inter, dtype=torch.bfloat16).reshape(experts, hidden, inter)
    other = torch.ones(4, 5)
    save_file({"a.norm": other, "m.experts.gate_up_proj": gate_up, "m.experts.down_proj": down}, tmp_path / "x")
    header = read_header(tmp_path / "x")
    split = split_experts(header, NAMES)
    assert split_experts(header, ()) == header  # nothing declared: nothing split
    expected = [f"m.experts.{e}.{p}.weight" for e in range(experts) for p in ("wg", "wu")] + \
               [f"m.experts.{e}.wd.weight" for e in range(experts)]
    assert sorted(split) == sorted(["a.norm", *expected])
    source = _Source(tmp_path / "x")
    try:
        for e in range(experts):
            for leaf, value in (("wg", gate_up[e, :inter]), ("wu", gate_up[e, inter:]), ("wd", down[e])):
                stored = split[f"m.experts.{e}.{leaf}.weight"]
                assert stored.shape == tuple(value.shape) and stored.dtype == "BF16"
                assert torch.equal(source.rows(stored, 0, stored.shape[0]), value), (e, leaf)
    finally:
        source.close()
    assert split["a.norm"] == header["a.norm"]
    save_file({"m.experts.gate_up_proj": torch.zeros(2, 3, 4)}, tmp_path / "odd")
    with pytest.raises(FusedExpertsError, match="even"):
        split_experts(read_header(tmp_path / "odd"), NAMES)


def test_expert_projections_are_three_distinct_leaf_names():
    assert ModelPatch(name="p", expert_projections=NAMES).shared_scale_sets() == (("wg", "wu"),)
    for bad in (("a", "b"), ("a", "a", "b"), ("a.b", "c", "d"), "abc"):
        with pytest.raises(ValueError, match="expert_projections must be three distinct leaf module names"):
            ModelPatch(name="bad", expert_projections=bad)


def test_the_zoo_moe_patches_unfuse_by_their_declaration():
    from layerwise.host.patch_selection import apply_patch
    from layerwise.model_zoo.mixtral import MIXTRAL

    assert MIXTRAL.expert_projections == ("w1", "w3", "w2")
    model = apply_patch(ARCHS["mixtral"].build(), MIXTRAL)
    names = {name for name, _ in model.named_modules()}
    assert {f"model.layers.0.mlp.experts.0.{leaf}" for leaf in MIXTRAL.expert_projections} <= names


def test_a_patch_copied_with_other_expert_names_unfuses_by_its_own_and_a_failed_apply_leaves_no_mark():
    import dataclasses

    from layerwise.host.patch_selection import applied_patch, apply_patch
    from layerwise.model_zoo.mixtral import MIXTRAL

    renamed = dataclasses.replace(MIXTRAL, name="mixtral-renamed", expert_projections=("wg", "wu", "wd"))
    model = apply_patch(ARCHS["mixtral"].build(), renamed)
    names = {name for name, _ in model.named_modules()}
    assert {f"model.layers.0.mlp.experts.0.{leaf}" for leaf in ("wg", "wu", "wd")} <= names
    assert not any(name.endswith(".w1") for name in names) and applied_patch(model) is renamed

    def failing(model):
        raise RuntimeError("apply failed")

    broken = dataclasses.replace(MIXTRAL, name="broken", apply=failing)
    fresh = ARCHS["mixtral"].build()
    with pytest.raises(RuntimeError, match="apply failed"):
        apply_patch(fresh, broken)
    assert applied_patch(fresh) is None


def test_without_a_declaration_fused_experts_stay_dense_and_the_forecast_and_report_say_so(tmp_path):
    from layerwise.planning.plan import plan_lines
    from layerwise.reports.text import summary_text
    from layerwise.verbs.options import CompressOptions

    torch.manual_seed(0)
    folder = save_fused(ARCHS["qwen3_moe"].build(), tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mystery-moe", architectures=["MysteryMoeForCausalLM"])  # no patch matches
    (folder / "config.json").write_text(json.dumps(config))
    options = CompressOptions.of(weights="model-free", workers=1)
    plan = layerwise.plan(str(folder), "W8A16", options=options)
    assert plan.ok, plan.errors
    assert sorted(plan.model_free.dense_experts) == [f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                                                     for p in ("down_proj", "gate_up_proj")]
    lines = "\n".join(plan_lines(plan))
    assert "note: fused MoE experts stay dense: model.layers.0.mlp.experts." in lines and "(4 tensors)" in lines
    report = compress_model_free(folder, "W8A16", tmp_path / "out", workers=1)
    assert len(report.notes) == 1 and "expert_projections" in report.notes[0]
    assert "note:               fused MoE experts stay dense" in summary_text(report)
    out, source = _tensors(tmp_path / "out"), _tensors(folder)
    assert torch.equal(out["model.layers.1.mlp.experts.gate_up_proj"], source["model.layers.1.mlp.experts.gate_up_proj"])
    assert not any(".experts.0." in name for name in out)
    saved = json.loads((tmp_path / "out" / "layerwise_summary.json").read_text())
    assert saved["notes"] == report.notes
    # the zoo's patch given by name splits them
    split = compress_model_free(folder, "W8A16", tmp_path / "split", workers=1, patch="qwen3_moe")
    assert not split.notes and "model.layers.1.mlp.experts.3.down_proj" in split.compressed_modules


def test_fused_experts_across_shards_split_where_each_tensor_is(tmp_path):
    torch.manual_seed(0)
    model = ARCHS["qwen3_moe"].build()
    folder = save_fused(model, tmp_path / "model")
    tensors = _tensors(folder)
    (folder / "model.safetensors").unlink()
    first = {k: v for k, v in tensors.items() if not k.endswith("down_proj")}
    second = {k: v for k, v in tensors.items() if k.endswith("down_proj")}
    save_file(first, folder / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file(second, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {**dict.fromkeys(first, "model-00001-of-00002.safetensors"),
                                            **dict.fromkeys(second, "model-00002-of-00002.safetensors")}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    recipe = "{QuantizationModifier: {scheme: W8A16, ignore: [lm_head, 're:.*mlp\\.gate$']}}"  # the router
    compress_model_free(folder, recipe, tmp_path / "free", workers=2)
    layerwise.compress(str(folder), recipe, output_dir=tmp_path / "memory", show_progress=False,
                       options=layerwise.CompressOptions.of(weights="memory"))
    free, mem = _tensors(tmp_path / "free"), _tensors(tmp_path / "memory")
    assert set(free) == set(mem) and all(torch.equal(free[name], mem[name]) for name in free)
    weight_map = json.loads((tmp_path / "free" / "model.safetensors.index.json").read_text())["weight_map"]
    assert weight_map["model.layers.1.mlp.experts.2.down_proj.weight_scale"] == "model-00002-of-00002.safetensors"
    assert weight_map["model.layers.1.mlp.experts.2.up_proj.weight_scale"] == "model-00001-of-00002.safetensors"
