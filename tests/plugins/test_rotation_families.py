"""RotationModifier on the zoo's families beyond Llama (mixture-of-experts decoders, vision-language models' text
towers): the outputs kept for every modality, composed with a quantizer through compress(), saved, and reloaded
with the same outputs."""

from __future__ import annotations

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization.online_rotation import online_hadamards
from layerwise.plugin import registry
from layerwise.plugin.quantization import RotationError
from layerwise.plugins.modifiers.quantization import QuantizationModifier
from layerwise.plugins.modifiers.rotation import RotationModifier

_PROJECTOR = "model.multi_modal_projector.linear_2"
_MERGER = "model.visual.merger.mlp.2"
#: family -> a module each rotated role must include: the layers Llama's layout would miss
FAMILIES = {
    "mixtral": {"readers": "model.layers.0.mlp.gate", "writers": "model.layers.0.mlp.experts.3.w2"},
    "qwen3_moe": {"readers": "model.layers.0.mlp.gate", "writers": "model.layers.0.mlp.experts.3.down_proj"},
    # MLA attention, a dense first layer, a shared expert beside the routed ones
    "deepseek_v3": {"readers": "model.layers.1.self_attn.kv_a_proj_with_mqa",
                    "writers": "model.layers.1.mlp.shared_experts.down_proj", "norms": "model.layers.0.input_layernorm"},
    "llava": {"writers": _PROJECTOR, "norms": "model.language_model.norm"},
    "mistral3": {"writers": _PROJECTOR, "norms": "model.language_model.norm"},
    "qwen2_vl": {"writers": _MERGER, "norms": "model.language_model.norm"},
    "qwen2_5_vl": {"writers": _MERGER, "norms": "model.language_model.norm"},
    "idefics3": {"writers": "model.connector.modality_projection.proj", "norms": "model.text_model.norm"},
    "mllama": {"readers": "model.language_model.layers.1.cross_attn.q_proj",
               "writers": "model.language_model.layers.1.cross_attn.o_proj"},
}
#: the modules of a vision tower, which the text tower's rotation leaves as they are
_VISION = ("vision", "visual.blocks", "visual.patch_embed")


def _inputs(family, model):
    """Every modality's sample inputs the family's patch builds (text; images for the vision-language models)."""
    patch = registry("model_patches").get(family)
    built = {}
    for modality in ("text", "image"):
        try:
            built[modality] = patch.sample_inputs(model.config, modality)
        except ValueError:
            continue
    return built


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits


def _compressed(family, tmp_path, rotation, quantizer=None):
    model = registry("model_patches").get(family).tiny_models[0]()
    out = tmp_path / family
    model = layerwise.compress(model, [rotation, quantizer or QuantizationModifier(scheme="W4A16", group_size=16)],
                               output_dir=out, show_progress=False, device="cpu")
    for role, name in FAMILIES[family].items():
        assert name in rotation.rotated[role]
    return model, out


@pytest.mark.parametrize("family", FAMILIES)
def test_rotation_alone_keeps_every_modality_s_outputs_and_leaves_the_vision_tower(family):
    model = registry("model_patches").get(family).tiny_models[0]()
    inputs = _inputs(family, model)
    before = {modality: _logits(model, given) for modality, given in inputs.items()}
    vision = {n: p.detach().clone() for n, p in model.named_parameters() if any(part in n for part in _VISION)}
    layerwise.compress(model, RotationModifier(seed=2), show_progress=False)
    for modality, given in inputs.items():
        torch.testing.assert_close(_logits(model, given), before[modality], rtol=1e-4, atol=1e-4)
    assert all(torch.equal(model.get_parameter(n), p) for n, p in vision.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_rotation_then_rtn_saves_a_checkpoint_transformers_reloads(family, tmp_path):
    model, out = _compressed(family, tmp_path, RotationModifier())
    reloaded = type(model).from_pretrained(out).eval()
    for given in _inputs(family, model).values():
        torch.testing.assert_close(_logits(reloaded, given), _logits(model, given), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family,experts,online,scheme", [
    ("mixtral", 8, 8, "FP8_DYNAMIC"), ("qwen3_moe", 8, 8, "FP8_DYNAMIC"), ("deepseek_v3", 4, 6, "FP8_DYNAMIC"),
    ("deepseek_v3", 4, 6, "W4A16")])
def test_online_rotation_of_every_expert_reloads_with_load_compressed(family, experts, online, scheme, tmp_path):
    """Every routed expert's down projection takes the online Hadamard (DeepSeek's dense and shared MLPs too)."""
    rotation = RotationModifier(online=True, online_signs=True, heads=family != "deepseek_v3")  # MLA: no v_proj
    quantizer = QuantizationModifier(scheme=scheme, **({"group_size": 16} if scheme == "W4A16" else {}))
    model, out = _compressed(family, tmp_path, rotation, quantizer)
    rotated = rotation.rotated["online"]
    assert len(rotated) == online and len([n for n in rotated if ".experts." in n]) == experts
    reloaded = layerwise.load_compressed(out).eval()
    assert sorted(online_hadamards(reloaded)) == sorted(online_hadamards(model)) == sorted(rotated)
    if scheme == "FP8_DYNAMIC":  # the experts' input quantization put back as well
        assert reloaded.get_submodule(next(n for n in rotated if ".experts." in n)).input_quantization_args
    (given,) = _inputs(family, model).values()
    assert torch.equal(_logits(reloaded, given), _logits(model, given))


@pytest.mark.parametrize("build", registry("model_patches").get("gemma3").tiny_models)
def test_gemma3_is_refused_with_its_reason_and_left_as_it_was(build):
    """Gemma3 adds normalised outputs to its stream (sandwich norms): no folded rotation keeps it exact."""
    model = build()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RotationError, match=r"Gemma3\w+ cannot be rotated exactly: its blocks normalise their "
                       r"attention and MLP outputs before adding them to the residual stream"):
        layerwise.compress(model, RotationModifier(online=True), show_progress=False)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("family,reason", [("bert", "it normalises after the residual add"),
                                           ("whisper", "proj_out, which has no bias")])
def test_layernorm_families_are_refused_with_their_reason_and_left_as_they_were(family, reason):
    """BERT (post-LN) and Whisper (LayerNorm shifts, a bias-less head, a GELU before the encoder's stream) declare
    why no folded rotation keeps them exact; the error says so before anything changes."""
    model = registry("model_patches").get(family).tiny_models[0]()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RotationError, match=rf"\w+ cannot be rotated exactly: .*{reason}"):
        layerwise.compress(model, RotationModifier(), show_progress=False)
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_online_rotation_of_a_text_tower_reloads_with_load_compressed(tmp_path):
    rotation = RotationModifier(online=True)
    model, out = _compressed("qwen2_5_vl", tmp_path, rotation)  # its vision blocks have a down_proj too
    assert rotation.rotated["online"] and all(n.startswith("model.language_model.") for n in rotation.rotated["online"])
    reloaded = layerwise.load_compressed(out).eval()
    assert sorted(online_hadamards(reloaded)) == sorted(rotation.rotated["online"])
    for given in _inputs("qwen2_5_vl", model).values():
        torch.testing.assert_close(_logits(reloaded, given), _logits(model, given), rtol=1e-5, atol=1e-5)
