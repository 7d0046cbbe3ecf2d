"""MoE experts saved as NVFP4 / MXFP4 / MXFP8 or int8 reload through load_compressed to the in-memory model exactly.

transformers 5.24 loads the saved per-expert layers into its fused experts and cannot decode these formats
there (NVFP4 without its global scale, MXFP4 in bfloat16, MXFP8 and int8 not at all): load_compressed leaves those
tensors out of what transformers reads, unfuses the experts with the model's patch and decodes them itself.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from zoo_tiny_models import ARCHS

from layerwise.model_zoo import moe

MOE = ["qwen3_moe", "mixtral", "deepseek_v3"]
#: every low-bit float preset; NVFP4 calibrates a global input scale per layer, the others read no data
FLOAT_PRESETS = ["NVFP4A16", "NVFP4", "MXFP4A16", "MXFP4", "MXFP8A16", "MXFP8"]


def _inputs(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def _recipe(name, preset):
    """``preset``, on DeepSeek-V3 with MX without its ``kv_b_proj`` (16 input columns: MX blocks are 32)."""
    if name == "deepseek_v3" and preset.startswith("MX"):
        return {"QuantizationModifier": {"scheme": preset, "targets": ["Linear"],
                                         "ignore": ["lm_head", "re:.*mlp\\.gate$", "re:.*kv_b_proj"]}}
    return preset


def _compressed(model, recipe, out, calibrated):
    """``model`` compressed with ``recipe`` and saved to ``out``; ``calibrated``: the recipe reads data (NVFP4's
    global input scales, FP8's static ones)."""
    import layerwise
    from layerwise.testing import token_batches

    data = token_batches(2, 12, vocab=model.config.vocab_size) if calibrated else None
    return layerwise.compress(model, recipe, dataset=data, output_dir=out, show_progress=False).eval()


def _reloaded(out, **kwargs):
    import layerwise

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about: every expert is decoded as saved
        return layerwise.load_compressed(out, **kwargs).eval()


@pytest.mark.parametrize("preset", FLOAT_PRESETS)
@pytest.mark.parametrize("name", MOE)
def test_float_format_experts_reload_to_the_in_memory_logits(name, preset, tmp_path):
    model = _compressed(ARCHS[name].build(), _recipe(name, preset), tmp_path / "out", calibrated=preset == "NVFP4")
    reloaded = _reloaded(tmp_path / "out")
    experts = moe.find_experts(reloaded)
    assert experts and all(isinstance(m, moe.LinearExperts) for m in experts.values())
    for layer_name, layer in model.named_modules():
        if ".experts." in layer_name and isinstance(layer, torch.nn.Linear):
            again = reloaded.get_submodule(layer_name)
            assert torch.equal(again.weight, layer.weight), layer_name
            if preset == "NVFP4":  # each expert's own calibrated global input scale, read back from the folder
                assert torch.equal(again.input_global_scale, layer.input_global_scale), layer_name
    inputs = _inputs(model)
    assert torch.equal(_logits(reloaded, inputs), _logits(model, inputs))


#: int8 weights (symmetric, and asymmetric with a zero point) with int8 inputs per token or static per tensor
INT8_RECIPES = {
    "W8A8": "W8A8",
    "W8A8_STATIC": "W8A8_STATIC",
    "W8A8 asymmetric weights": {"QuantizationModifier": {"scheme": "W8A8", "symmetric": False,
                                                         "ignore": ["lm_head", "re:.*mlp\\.gate$"]}},
    "W8A8 asymmetric weights per tensor": {"QuantizationModifier": {
        "scheme": "W8A8", "symmetric": False, "strategy": "tensor", "ignore": ["lm_head", "re:.*mlp\\.gate$"]}},
}


@pytest.mark.parametrize("recipe", list(INT8_RECIPES))
@pytest.mark.parametrize("name", MOE)
def test_int8_experts_reload_to_the_in_memory_logits(name, recipe, tmp_path):
    """transformers 5.24 refuses int8 MoE folders outright (its expert conversion takes FP8 and packed weights
    only); load_compressed decodes every expert's int8 values, scale and zero point, and its input scales."""
    model = _compressed(ARCHS[name].build(), INT8_RECIPES[recipe], tmp_path / "out", calibrated=True)
    reloaded = _reloaded(tmp_path / "out")
    for layer_name, layer in model.named_modules():
        if ".experts." in layer_name and isinstance(layer, torch.nn.Linear):
            again = reloaded.get_submodule(layer_name)
            assert torch.equal(again.weight, layer.weight), layer_name
            served = [(args.num_bits, args.type, args.symmetric, args.strategy, args.dynamic)  # not the observer
                      for args in (again.input_quantization_args, layer.input_quantization_args)]
            assert served[0] == served[1], layer_name
            if recipe == "W8A8_STATIC":
                assert torch.equal(again.input_scale, layer.input_scale), layer_name
    inputs = _inputs(model)
    assert torch.equal(_logits(reloaded, inputs), _logits(model, inputs))


MIXED = {
    "nvfp4-experts-fp8-attention": [
        {"QuantizationModifier": {"scheme": "NVFP4", "targets": [r"re:.*experts\..*"]}},
        {"QuantizationModifier": {"scheme": "FP8", "targets": [r"re:.*self_attn\..*_proj$"]}}],
    "fp8-experts-nvfp4-attention": [
        {"QuantizationModifier": {"scheme": "FP8", "targets": [r"re:.*experts\..*"]}},
        {"QuantizationModifier": {"scheme": "NVFP4", "targets": [r"re:.*self_attn\..*_proj$"]}}],
    "mxfp8-experts-w8a16-attention": [
        {"QuantizationModifier": {"scheme": "MXFP8", "targets": [r"re:.*experts\..*"]}},
        {"QuantizationModifier": {"scheme": "W8A16", "targets": [r"re:.*self_attn\.(q|k|v|o)_proj$"]}}],
}


@pytest.mark.parametrize("recipe", list(MIXED))
@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_mixed_precision_moe_folders_reload_to_the_in_memory_logits(name, recipe, tmp_path):
    """Float-format experts beside an FP8 / int8 group; FP8 experts (fused by transformers, unfused by
    restore_expert_inputs) beside NVFP4 attention, Mixtral's w1 / w3 / w2 names and DeepSeek's shared experts
    (plain Linears, their static FP8 input scales read back) included."""
    model = _compressed(ARCHS[name].build(), MIXED[recipe], tmp_path / "out", calibrated="mxfp8" not in recipe)
    inputs = _inputs(model)
    assert torch.equal(_logits(_reloaded(tmp_path / "out"), inputs), _logits(model, inputs))


@pytest.mark.parametrize("preset", ["NVFP4", "MXFP8", "W8A8_STATIC"])
def test_a_bfloat16_reload_decodes_float_format_experts_too(preset, tmp_path):
    """In bfloat16 load_compressed otherwise runs compressed-tensors' forward, which gets no expert right."""
    model = ARCHS["qwen3_moe"].build()
    rotary = {n: b.clone() for n, b in model.named_buffers() if "rotary" in n}  # from_pretrained keeps them float32
    model.to(torch.bfloat16)
    for buffer_name, buffer in rotary.items():
        owner, _, attr = buffer_name.rpartition(".")
        setattr(model.get_submodule(owner), attr, buffer)
    model = _compressed(model, preset, tmp_path / "out", calibrated=preset in ("NVFP4", "W8A8_STATIC"))
    reloaded = _reloaded(tmp_path / "out", dtype=torch.bfloat16)
    inputs = _inputs(model)
    assert torch.equal(_logits(reloaded, inputs), _logits(model, inputs))


def test_float_format_experts_no_patch_unfuses_are_refused(tmp_path, monkeypatch):
    import layerwise
    from layerwise.errors import ModelLoadError
    from layerwise.host import patch_selection

    _compressed(ARCHS["qwen3_moe"].build(), "MXFP8", tmp_path / "out", calibrated=False)
    monkeypatch.setattr(patch_selection, "resolve_patch", lambda model, patch=None: None)
    with pytest.raises(ModelLoadError, match=r"MoE experts' layers \(model\.layers\.0\.mlp\.experts\.0\.down_proj and "
                                             r"23 more\) as NVFP4 / MXFP4 / MXFP8.*no model patch unfuses"):
        layerwise.load_compressed(tmp_path / "out")


def test_nvfp4_experts_left_to_transformers_are_warned_about(tmp_path):
    """A quantization_config of the caller's own skips layerwise's decoding: transformers' fused NVFP4 experts
    have neither their weights nor their input quantization right, and the warning says both."""
    from transformers import CompressedTensorsConfig

    import layerwise

    _compressed(ARCHS["qwen3_moe"].build(), "NVFP4", tmp_path / "out", calibrated=True)
    with pytest.warns(UserWarning, match=r"MoE experts \(model\.layers\.0\.mlp\.experts and 1 more\) run without the "
                                         r"input quantization .*local folder's per-expert tensors only.*the experts' "
                                         r"weights are not the saved ones either"):
        layerwise.load_compressed(tmp_path / "out", quantization_config=CompressedTensorsConfig(dequantize=True))
