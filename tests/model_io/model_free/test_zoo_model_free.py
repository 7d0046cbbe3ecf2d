"""Every zoo model whose checkpoint keeps its layers as 2-D weights: model-free writes the in-memory run's bytes.

MoE families are left out: their checkpoints hold the experts fused (3-D tensors), which the zoo's patches
unfuse into Linear layers on load; model-free, seeing tensors only, leaves fused experts as they are.
Families whose checkpoints transformers renames on load (``model.layers`` saved for the module
``model.language_model.layers``: Qwen2-VL, Llava, Mllama, Gemma3, ...) are compared under the checkpoint's
names, which both runs write (transformers renames back on save): the layers the in-memory run quantized
are read from its output, and model-free is given the rest as its ignore list.
"""

from __future__ import annotations

import json

import pytest
import torch

import layerwise
from layerwise.model_io.model_free import compress_model_free
from tests.model_io.model_free.test_model_free import _tensors
from tests.model_zoo.zoo_tiny_models import ARCHS

FUSED_EXPERTS = ("qwen3_moe", "mixtral", "deepseek_v3")


@pytest.mark.parametrize("arch", [name for name in ARCHS if name not in FUSED_EXPERTS])
def test_zoo_model_free_is_bit_identical(arch, tmp_path):
    torch.manual_seed(0)
    model = ARCHS[arch].build()
    model.save_pretrained(tmp_path / "model")
    layerwise.compress(str(tmp_path / "model"), "W8A16", output_dir=tmp_path / "memory", show_progress=False,
                       options=layerwise.CompressOptions.of(weights="memory"))
    # the layers the in-memory run quantized, by the names its output (and the checkpoint) gives them: transformers
    # renames some families' tensors on load (model.layers -> model.language_model.layers) and back on save
    quantized = {name.removesuffix(".weight_scale") for name in _tensors(tmp_path / "memory")
                 if name.endswith(".weight_scale")}
    saved = _tensors(tmp_path / "model")
    layers = {name.removesuffix(".weight") for name, t in saved.items() if name.endswith(".weight") and t.dim() == 2}
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
