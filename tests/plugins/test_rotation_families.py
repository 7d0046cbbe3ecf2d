"""RotationModifier on the zoo's families beyond Llama (mixture-of-experts decoders): composed with a quantizer
through compress(), saved, and reloaded with the same outputs."""

from __future__ import annotations

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization.online_rotation import online_hadamards
from layerwise.plugin import registry
from layerwise.plugins.modifiers.quantization import QuantizationModifier
from layerwise.plugins.modifiers.rotation import RotationModifier

#: family -> a module each of its rotated roles must include (the layers Llama's layout would miss)
FAMILIES = {
    "mixtral": {"readers": "model.layers.0.mlp.gate", "writers": "model.layers.0.mlp.experts.3.w2"},
    "qwen3_moe": {"readers": "model.layers.0.mlp.gate", "writers": "model.layers.0.mlp.experts.3.down_proj"},
}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _compressed(family, tmp_path, rotation, quantizer=None):
    patch = registry("model_patches").get(family)
    model = patch.tiny_models[0]()
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(0))
    out = tmp_path / family
    model = layerwise.compress(model, [rotation, quantizer or QuantizationModifier(scheme="W4A16", group_size=32)],
                               output_dir=out, show_progress=False, device="cpu")
    for role, name in FAMILIES[family].items():
        assert name in rotation.rotated[role]
    return model, out, ids


@pytest.mark.parametrize("family", FAMILIES)
def test_rotation_alone_keeps_the_outputs(family):
    model = registry("model_patches").get(family).tiny_models[0]()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    layerwise.compress(model, RotationModifier(seed=2), show_progress=False)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_rotation_then_rtn_saves_a_checkpoint_transformers_reloads(family, tmp_path):
    model, out, ids = _compressed(family, tmp_path, RotationModifier())
    reloaded = type(model).from_pretrained(out).eval()
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_online_rotation_of_every_expert_reloads_with_load_compressed(family, tmp_path):
    rotation = RotationModifier(online=True, online_signs=True, heads=True)
    model, out, ids = _compressed(family, tmp_path, rotation, QuantizationModifier(scheme="FP8_DYNAMIC"))
    experts = [n for n in rotation.rotated["online"] if ".experts." in n]
    assert len(experts) == len(rotation.rotated["online"]) == 2 * 4  # every expert of both layers
    reloaded = layerwise.load_compressed(out).eval()
    assert sorted(online_hadamards(reloaded)) == sorted(online_hadamards(model)) == sorted(experts)
    expert = reloaded.get_submodule(experts[-1])
    assert expert.input_quantization_args is not None  # the experts' input quantization put back as well
    assert torch.equal(_logits(reloaded, ids), _logits(model, ids))
