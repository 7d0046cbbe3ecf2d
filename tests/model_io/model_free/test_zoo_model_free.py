"""Every zoo model: model-free writes the in-memory run's bytes.

MoE families are compared twice: from the checkpoint ``save_pretrained`` writes (transformers 5.24 writes
the experts back per expert, 2-D) and from one holding them fused (the 3-D ``experts.gate_up_proj`` /
``experts.down_proj`` of the modules, as transformers 5 keeps them): model-free splits those by the patch's
``expert_projections``, as the in-memory run unfuses them by it.
Families whose checkpoints transformers renames on load (``model.layers`` saved for the module
``model.language_model.layers``: Qwen2-VL, Llava, Mllama, Gemma3, ...) are compared under the checkpoint's
names, which both runs write (transformers renames back on save): the layers the in-memory run quantized
are read from its output, and model-free is given the rest as its ignore list.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import layerwise
from layerwise.model_io.model_free import compress_model_free
from tests.model_io.model_free.test_model_free import _tensors
from tests.model_zoo.zoo_tiny_models import ARCHS

MOE = ("qwen3_moe", "mixtral", "deepseek_v3")


def save_fused(model: torch.nn.Module, folder: Path) -> Path:
    """``model`` saved with its modules' own tensors (MoE experts fused, 3-D), not the per-expert ones
    ``save_pretrained`` writes back: the checkpoint of a transformers 5 layout."""
    model.save_pretrained(folder)
    for file in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]:
        file.unlink()
    seen, tensors = set(), {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:  # a tied lm_head is the embedding's tensor: saved once
            seen.add(tensor.data_ptr())
            tensors[name] = tensor.detach().contiguous()
    assert any(t.dim() == 3 for t in tensors.values())
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("arch,fused", [(name, False) for name in ARCHS] + [(name, True) for name in MOE])
def test_zoo_model_free_is_bit_identical(arch, fused, tmp_path):
    torch.manual_seed(0)
    model = ARCHS[arch].build()
    if fused:
        save_fused(model, tmp_path / "model")
    else:
        model.save_pretrained(tmp_path / "model")
    layerwise.compress(str(tmp_path / "model"), "W8A16", output_dir=tmp_path / "memory", show_progress=False,
                       options=layerwise.CompressOptions.of(weights="memory"))
    # the layers the in-memory run quantized, by the names its output (and the checkpoint) gives them: transformers
    # renames some families' tensors on load (model.layers -> model.language_model.layers) and back on save
    quantized = {name.removesuffix(".weight_scale") for name in _tensors(tmp_path / "memory")
                 if name.endswith(".weight_scale")}
    saved = _tensors(tmp_path / "model")
    layers = {name.removesuffix(".weight") for name, t in saved.items() if name.endswith(".weight") and t.dim() == 2}
    if fused:  # the per-expert layers the split gives
        assert any(name.endswith(".weight_scale") and ".experts.0." in name for name in _tensors(tmp_path / "memory"))
        layers |= {name for name in quantized if ".experts." in name}
    # the patch's ignore list names classes and towers model-free cannot see: the same layers, by name
    ignore = sorted(layers - quantized)
    recipe = {"QuantizationModifier": {"scheme": "W8A16", "targets": ["re:.*"], "ignore": ignore}}
    report = compress_model_free(tmp_path / "model", recipe, tmp_path / "free", workers=1)
    assert set(report.compressed_modules) == quantized
    free, mem = _tensors(tmp_path / "free"), _tensors(tmp_path / "memory")
    assert set(free) == set(mem)
    for name in free:
        assert free[name].dtype == mem[name].dtype and torch.equal(free[name], mem[name]), name
    groups = [json.loads((tmp_path / which / "config.json").read_text())["quantization_config"]["config_groups"]
              for which in ("free", "memory")]
    assert groups[0] == groups[1]


def test_nvfp4_of_fused_experts_is_bit_identical_and_each_experts_gate_and_up_share_a_global_scale(tmp_path):
    torch.manual_seed(0)
    folder = save_fused(ARCHS["qwen3_moe"].build(), tmp_path / "model")
    recipe = "{QuantizationModifier: {scheme: NVFP4A16, ignore: [lm_head, 're:.*mlp\\.gate$']}}"
    compress_model_free(folder, recipe, tmp_path / "free", workers=1)
    layerwise.compress(str(folder), recipe, output_dir=tmp_path / "memory", show_progress=False,
                       options=layerwise.CompressOptions.of(weights="memory"))
    free, mem = _tensors(tmp_path / "free"), _tensors(tmp_path / "memory")
    assert set(free) == set(mem) and all(torch.equal(free[name], mem[name]) for name in free)
    source = _tensors(folder)["model.layers.1.mlp.experts.gate_up_proj"]
    for e in range(source.shape[0]):
        gate, up = (free[f"model.layers.1.mlp.experts.{e}.{p}.weight_global_scale"] for p in ("gate_proj", "up_proj"))
        assert torch.equal(gate, up) and torch.allclose(gate, 448 * 6 / source[e].abs().amax().float())
    q, k, v = (free[f"model.layers.1.self_attn.{p}_proj.weight_global_scale"] for p in "qkv")
    assert torch.equal(q, k) and torch.equal(q, v)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_by_default_model_free_leaves_out_what_the_in_memory_run_leaves_out(arch, tmp_path):
    """No ignore given: the model patch matched from config.json supplies its ignore list (routers, heads, vision
    towers), as compress() in memory takes it; a MoE router quantized by model-free alone would not load in vLLM."""
    torch.manual_seed(0)
    ARCHS[arch].build().save_pretrained(tmp_path / "model")
    layerwise.compress(str(tmp_path / "model"), "W8A16", output_dir=tmp_path / "memory", show_progress=False,
                       options=layerwise.CompressOptions.of(weights="memory"))
    quantized = {name.removesuffix(".weight_scale") for name in _tensors(tmp_path / "memory")
                 if name.endswith(".weight_scale")}
    report = compress_model_free(tmp_path / "model", "W8A16", tmp_path / "free", workers=1)
    assert set(report.compressed_modules) == quantized
    if arch in MOE:
        assert not any(name.endswith("mlp.gate") for name in report.compressed_modules)
