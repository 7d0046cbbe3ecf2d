"""MoE: unfused per-expert Linear layers and the all-expert calibration swap."""

from __future__ import annotations

import pytest
import torch
from zoo_tiny_models import ARCHS

from layerwise.model_zoo import moe

MOE = ["qwen3_moe", "mixtral", "deepseek_v3"]


def _inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs, use_cache=False).logits


def _count_rows(model):
    """Forward hooks on every expert Linear: rows seen per expert module name."""
    seen, handles = {}, []
    for name, experts in moe.find_experts(model).items():
        for e, mlp in enumerate(experts):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                key = f"{name}.{e}.{proj}"
                seen[key] = 0

                def hook(_m, args, _out, key=key):
                    seen[key] += args[0].reshape(-1, args[0].shape[-1]).shape[0]

                handles.append(getattr(mlp, proj).register_forward_hook(hook))
    return seen, handles


@pytest.mark.parametrize("name", MOE)
def test_unfused_experts_are_linear_and_give_the_same_output(name):
    model = ARCHS[name].build()
    inputs = _inputs(model)
    fused = _logits(model, inputs)
    assert moe.find_experts(model) and all(moe.is_fused_experts(m) for m in moe.find_experts(model).values())
    moe.unfuse_experts(model)
    experts = moe.find_experts(model)
    assert experts and all(isinstance(m, moe.LinearExperts) for m in experts.values())
    assert all(isinstance(mlp.gate_proj, torch.nn.Linear) for m in experts.values() for mlp in m)
    torch.testing.assert_close(_logits(model, inputs), fused, atol=1e-6, rtol=1e-6)
    moe.unfuse_experts(model)  # idempotent
    assert set(moe.find_experts(model)) == set(experts)


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("unfused", [True, False], ids=["linear", "fused"])
def test_calibration_swap_keeps_outputs_and_restores_forward(name, unfused):
    model = ARCHS[name].build()
    if unfused:
        moe.unfuse_experts(model)
    inputs = _inputs(model)
    normal = _logits(model, inputs)
    with moe.calibrate_all_experts(model) as swapped:
        assert set(swapped) == set(moe.find_experts(model))
        torch.testing.assert_close(_logits(model, inputs), normal, atol=1e-6, rtol=1e-6)
    assert all("forward" not in m.__dict__ for m in moe.find_experts(model).values())
    with pytest.raises(RuntimeError, match="boom"), moe.calibrate_all_experts(model):
        raise RuntimeError("boom")
    assert all("forward" not in m.__dict__ for m in moe.find_experts(model).values())
    torch.testing.assert_close(_logits(model, inputs), normal, atol=0, rtol=0)


@pytest.mark.parametrize("name", MOE)
def test_every_expert_sees_every_token_only_while_calibrating(name):
    model = ARCHS[name].build()
    moe.unfuse_experts(model)
    inputs = _inputs(model)
    tokens = inputs["input_ids"].numel()

    seen, handles = _count_rows(model)
    try:
        _logits(model, inputs)
        routed = dict(seen)
        seen.update({k: 0 for k in seen})
        with moe.calibrate_all_experts(model):
            _logits(model, inputs)
    finally:
        for h in handles:
            h.remove()
    assert all(v == tokens for v in seen.values()), seen
    # normal routing is really top-k: the experts together see top_k * tokens rows per layer
    top_k = model.config.num_experts_per_tok
    per_layer = {}
    for key, rows in routed.items():
        if key.endswith("gate_proj"):
            layer = key.split(".experts.")[0]
            per_layer[layer] = per_layer.get(layer, 0) + rows
    assert per_layer and all(v == top_k * tokens for v in per_layer.values())


@pytest.mark.parametrize("name", MOE)
def test_patch_unfuses_on_apply_and_calibrates_through_its_context(name):
    import importlib

    from layerwise.host.patch_selection import apply_patch

    patch = getattr(importlib.import_module(f"layerwise.model_zoo.{name}"), name.upper())
    model = ARCHS[name].build()
    inputs = _inputs(model)
    normal = _logits(model, inputs)
    apply_patch(model, patch)
    assert all(isinstance(m, moe.LinearExperts) for m in moe.find_experts(model).values())
    with patch.calibrating(model):
        torch.testing.assert_close(_logits(model, inputs), normal, atol=1e-6, rtol=1e-6)
    # routers stay out of compression
    from layerwise.common.matching import find_modules
    linears = find_modules(model, ["Linear"], patch.ignore)
    # the unfused experts are named as the family's original checkpoints name them (so they reload)
    gate = "w1" if name == "mixtral" else "gate_proj"
    assert any(n.endswith(f".experts.0.{gate}") for n in linears)
    assert not any(n.endswith("mlp.gate") for n in linears)


@pytest.mark.parametrize("recipe", ["FP8_DYNAMIC", "W8A16"])
def test_a_reloaded_moe_quantizes_its_experts_inputs_as_the_compressed_model_did(recipe, tmp_path):
    """transformers 5 loads the saved per-expert layers back fused and runs them without their input quantization
    (a review measured 0.026 on Qwen3-MoE's logits): load_compressed unfuses them and puts it back."""
    import warnings

    import layerwise

    model = ARCHS["qwen3_moe"].build()
    layerwise.compress(model, recipe, output_dir=tmp_path / "out", show_progress=False)
    inputs = _inputs(model)
    expected = _logits(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about: everything is put back
        reloaded = layerwise.load_compressed(tmp_path / "out").eval()
    experts = moe.find_experts(reloaded)
    if recipe == "W8A16":  # weights only: the fused experts compute what the saved ones do, left as loaded
        assert experts and not any(isinstance(m, moe.LinearExperts) for m in experts.values())
    else:
        assert experts and all(isinstance(m, moe.LinearExperts) for m in experts.values())
        assert next(iter(experts.values()))[0].gate_proj.input_quantization_args is not None
    torch.testing.assert_close(_logits(reloaded, inputs), expected, atol=1e-5, rtol=1e-5)


def _static_fp8(name, out):
    """The family's tiny model compressed with FP8 (static input scales, calibrated) and saved to ``out``."""
    import layerwise
    from layerwise.testing import token_batches

    model = ARCHS[name].build()
    return layerwise.compress(model, "FP8", dataset=token_batches(2, 12, vocab=model.config.vocab_size),
                              output_dir=out, show_progress=False).eval()


@pytest.mark.parametrize("name", MOE)
def test_each_reloaded_expert_quantizes_its_inputs_with_its_own_saved_static_scale(name, tmp_path):
    """transformers drops the experts' ``input_scale`` tensors (it loads the experts fused): load_compressed
    unfuses them and reads each one's scale back from the folder, Mixtral's ``block_sparse_moe`` names too."""
    import warnings

    import layerwise

    model = _static_fp8(name, tmp_path / "out")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing to warn about: every scale is put back
        reloaded = layerwise.load_compressed(tmp_path / "out").eval()
    layers = {n: m for n, m in model.named_modules() if ".experts." in n and hasattr(m, "input_scale")}
    assert len(layers) >= 12 and len({layer.input_scale.item() for layer in layers.values()}) > 1  # one per expert
    for layer_name, layer in layers.items():
        assert torch.equal(reloaded.get_submodule(layer_name).input_scale, layer.input_scale), layer_name
    inputs = _inputs(model)
    assert torch.equal(_logits(reloaded, inputs), _logits(model, inputs))


def test_experts_whose_saved_static_scales_are_missing_are_warned_about(tmp_path):
    from safetensors.torch import load_file, save_file

    import layerwise

    _static_fp8("qwen3_moe", tmp_path / "out")
    weights = tmp_path / "out" / "model.safetensors"
    tensors = {k: v for k, v in load_file(weights).items() if not (".experts." in k and k.endswith(".input_scale"))}
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"MoE experts \(model\.layers\.0\.mlp\.experts\.0\.gate_proj and 23 more\) run "
                      r"without the input quantization .*no calibrated input scales for them"):
        layerwise.load_compressed(tmp_path / "out")
