"""Online Hadamard rotations before a Linear: the function kept, the calibration seeing the rotated
inputs, compressed-tensors' transform_config written and read back."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from layerwise.algorithms.quantization.hadamard import hadamard_matrix
from layerwise.algorithms.quantization.online_rotation import (
    OnlineHadamard,
    OnlineRotationError,
    attach_from_transform_config,
    flip_online_signs,
    online_hadamards,
    online_only,
    rotate_inputs_online,
    transform_config,
)
from layerwise.algorithms.quantization.rotation import (
    LLAMA_LIKE,
    RotationError,
    rotate_heads,
    rotate_residual_stream,
)
from layerwise.plugin import apply_patch, registry
from tests.conftest import build_tiny_llama

ONLINE_FAMILIES = sorted(name for name, patch in registry("model_patches").items()
                         if patch.rotation_layout and patch.rotation_layout.online)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _ids(vocab=128, seed=3):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(seed))


def test_llama_declares_down_proj_online():
    assert "llama" in ONLINE_FAMILIES and LLAMA_LIKE.online == ("re:.*mlp\\.down_proj$",)


@pytest.mark.parametrize("family", ONLINE_FAMILIES)
def test_residual_and_online_rotations_keep_each_declared_family_s_function(family):
    patch = registry("model_patches").get(family)
    for build in patch.tiny_models:
        model = apply_patch(build(), patch)
        for norm in (m for n, m in model.named_modules() if n.endswith("norm")):
            norm.weight.data.uniform_(0.5, 1.5)
        ids = _ids(model.config.get_text_config().vocab_size)
        before = _logits(model, ids)
        # every MLP's down projection, an expert's under its checkpoint name (Mixtral's w2)
        expert_down = patch.expert_projections[2] if patch.expert_projections else "down_proj"
        # the text decoder's layers only: a vision tower's v_proj and down_proj (CLIP, Qwen2.5-VL) stay as they are
        text = {n: m for n, m in model.named_modules() if not any(part in n for part in ("vision", "visual"))}
        down = {n: m.weight.detach().clone() for n, m in text.items() if n.endswith(("down_proj", f".{expert_down}"))}
        values = {n: m.weight.detach().clone() for n, m in text.items() if n.endswith("self_attn.v_proj")}
        rotate_residual_stream(model, patch.rotation_layout, "hadamard", seed=1)
        rotated = rotate_inputs_online(model, patch.rotation_layout.online)
        assert sorted(rotated) == sorted(down)
        if patch.rotation_layout.heads:
            with_residual = {n: model.get_submodule(n).weight.detach().clone() for n in values}
            assert len(rotate_heads(model, patch.rotation_layout.heads)) == len(values)
            assert not any(torch.allclose(model.get_submodule(n).weight, w) for n, w in with_residual.items())
        torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
        assert all(isinstance(online_hadamards(model)[n], OnlineHadamard) for n in down)


@pytest.mark.parametrize("block", [None, 32])
def test_the_weight_gets_the_hadamard_and_the_input_is_rotated_first(block):
    model = build_tiny_llama()
    ids = _ids()
    before = _logits(model, ids)
    down = model.model.layers[0].mlp.down_proj
    width = down.in_features
    size = block or width
    h = torch.block_diag(*[hadamard_matrix(size)] * (width // size)) / math.sqrt(size)
    weight = down.weight.detach().double().clone()
    seen, raw = [], []
    down.register_forward_pre_hook(lambda m, args: raw.append(args[0].detach().clone()))
    rotate_inputs_online(model, ["re:.*mlp\\.down_proj$"], block)
    later = down.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))  # like GPTQ's
    torch.testing.assert_close(down.weight.double(), weight @ h, rtol=1e-6, atol=1e-6)
    after = _logits(model, ids)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    # the rotation runs first, so a hook registered before it sees the rotated input too
    torch.testing.assert_close(seen[0].double(), raw[0].double(), rtol=0, atol=0)
    later.remove()
    plain = build_tiny_llama()
    captured = []
    plain.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, args: captured.append(args[0]))
    _logits(plain, ids)
    torch.testing.assert_close(seen[0].double(), captured[0].double() @ h, rtol=1e-5, atol=1e-5)


def test_signs_make_the_online_hadamard_a_random_one_and_keep_the_function_exactly():
    model = build_tiny_llama()
    ids = _ids()
    before = _logits(model, ids)
    mlp = model.model.layers[0].mlp
    up, down = mlp.up_proj.weight.detach().double().clone(), mlp.down_proj.weight.detach().double().clone()
    plain = []
    model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, args: plain.append(args[0].double()))
    _logits(model, ids)
    assert flip_online_signs(model, LLAMA_LIKE.online_signs, seed=5) == ["model.layers.0.mlp.down_proj",
                                                                          "model.layers.1.mlp.down_proj"]
    signs = mlp.up_proj.weight.double()[:, 0] / up[:, 0]
    assert set(signs.tolist()) == {-1.0, 1.0}
    assert torch.equal(mlp.up_proj.weight.double(), up * signs.unsqueeze(1))  # rows of up_proj, columns of down
    assert torch.equal(mlp.down_proj.weight.double(), down * signs)
    assert torch.equal(_logits(model, ids), before)  # multiplying by +-1 is exact
    seen = []
    rotate_inputs_online(model, LLAMA_LIKE.online)
    mlp.down_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0].double()))
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-5, atol=1e-5)
    width = mlp.down_proj.in_features
    h = hadamard_matrix(width) / math.sqrt(width)
    random_hadamard = torch.diag(signs) @ h  # the input x becomes x D H, the weight W D H
    torch.testing.assert_close(seen[0], plain[0] @ random_hadamard, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mlp.down_proj.weight.double(), down @ random_hadamard, rtol=1e-6, atol=1e-6)
    other = build_tiny_llama()
    flip_online_signs(other, LLAMA_LIKE.online_signs, seed=6)
    assert not torch.equal(other.model.layers[0].mlp.up_proj.weight.double(), up * signs.unsqueeze(1))


def test_signs_errors_name_the_pairing():
    model = build_tiny_llama()
    with pytest.raises(OnlineRotationError, match="scale pattern, online pattern"):
        flip_online_signs(model, ("re:.*up_proj$",))
    with pytest.raises(OnlineRotationError, match="one scale and one online layer"):
        flip_online_signs(model, ("re:.*up_proj$", "re:.*o_proj$"))
    narrow = build_tiny_llama()
    narrow.model.layers[1].mlp.up_proj = torch.nn.Linear(narrow.config.hidden_size, 8)
    kept = narrow.model.layers[0].mlp.up_proj.weight.detach().clone()
    with pytest.raises(OnlineRotationError, match="must be a Linear whose outputs"):
        flip_online_signs(narrow, LLAMA_LIKE.online_signs)
    assert torch.equal(narrow.model.layers[0].mlp.up_proj.weight, kept)  # checked before any change
    rotate_inputs_online(model, LLAMA_LIKE.online)
    with pytest.raises(OnlineRotationError, match="before the Hadamard is folded"):
        flip_online_signs(model, LLAMA_LIKE.online_signs)


def test_a_deep_copy_keeps_the_online_rotation():
    model = build_tiny_llama()
    rotate_inputs_online(model, LLAMA_LIKE.online)
    ids = _ids()
    copied = copy.deepcopy(model)
    assert sorted(online_hadamards(copied)) == sorted(online_hadamards(model))
    torch.testing.assert_close(_logits(copied, ids), _logits(model, ids), rtol=0, atol=0)


def test_errors_name_the_layer_and_the_fix():
    model = build_tiny_llama(intermediate_size=96)
    with pytest.raises(OnlineRotationError, match="set the block size to 32.*block_size"):
        rotate_inputs_online(model, LLAMA_LIKE.online)
    assert not online_hadamards(model)  # checked before any change
    with pytest.raises(OnlineRotationError, match="match no module"):
        rotate_inputs_online(model, ["re:.*fc2$"])
    with pytest.raises(OnlineRotationError, match="nn.Linear layers only"):
        rotate_inputs_online(model, ["re:.*mlp$"])
    rotate_inputs_online(model, LLAMA_LIKE.online, block=32)
    with pytest.raises(OnlineRotationError, match="already rotates"):
        rotate_inputs_online(model, LLAMA_LIKE.online, block=32)


def test_transform_config_is_compressed_tensors_and_reads_back():
    from compressed_tensors.transform import TransformConfig

    model = build_tiny_llama()
    assert transform_config(model) is None
    rotate_inputs_online(model, LLAMA_LIKE.online)
    config = transform_config(model)
    parsed = TransformConfig.model_validate(config)
    (scheme,) = parsed.config_groups.values()
    assert scheme.type == "hadamard" and not scheme.randomize and scheme.head_dim is None
    assert [(a.location, a.inverse) for a in scheme.apply] == [("input", False), ("weight_input", True)]
    assert scheme.apply[0].targets == sorted(online_hadamards(model))
    assert [a.location for a in online_only(config).config_groups["R4"].apply] == ["input"]

    fresh = build_tiny_llama()
    assert sorted(attach_from_transform_config(fresh, config)) == sorted(online_hadamards(model))
    assert {h.block for h in online_hadamards(fresh).values()} == {fresh.config.intermediate_size}

    blocked = build_tiny_llama()
    rotate_inputs_online(blocked, LLAMA_LIKE.online, block=32)
    assert TransformConfig.model_validate(transform_config(blocked)).config_groups["R4"].head_dim == 32

    config["config_groups"]["R4"]["precision"] = "torch.float64"  # as llm-compressor writes it on CPU
    precise = build_tiny_llama()
    attach_from_transform_config(precise, config)
    assert {h.precision for h in online_hadamards(precise).values()} == {torch.float64}
    assert TransformConfig.model_validate(transform_config(precise)).config_groups["R4"].precision == torch.float64


def test_transforms_layerwise_does_not_regenerate_are_refused_with_the_alternative():
    model = build_tiny_llama()
    rotate_inputs_online(model, LLAMA_LIKE.online)
    config = transform_config(model)
    config["config_groups"]["R4"]["type"] = "random-hadamard"
    with pytest.raises(OnlineRotationError, match="apply_transform_config"):
        attach_from_transform_config(build_tiny_llama(), config)
    config["config_groups"]["R4"]["type"] = "hadamard"
    config["config_groups"]["R4"]["apply"][0]["targets"] = ["re:.*nothing$"]
    with pytest.raises(OnlineRotationError, match="match no module"):
        attach_from_transform_config(build_tiny_llama(), config)


def test_per_head_rotation_is_a_hadamard_per_head_on_both_sides():
    model = build_tiny_llama()
    ids = _ids()
    before = _logits(model, ids)
    attention = model.model.layers[0].self_attn
    v, o = attention.v_proj.weight.detach().double().clone(), attention.o_proj.weight.detach().double().clone()
    d = model.config.head_dim
    rotate_heads(model, LLAMA_LIKE.heads)
    h_kv = torch.block_diag(*[hadamard_matrix(d)] * (v.shape[0] // d)) / math.sqrt(d)
    h_q = torch.block_diag(*[hadamard_matrix(d)] * (o.shape[1] // d)) / math.sqrt(d)
    torch.testing.assert_close(attention.v_proj.weight.double(), h_kv @ v, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(attention.o_proj.weight.double(), o @ h_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-5, atol=1e-5)
    with pytest.raises(RotationError, match="value pattern, output pattern"):
        rotate_heads(model, ("re:.*v_proj$",))
    with pytest.raises(RotationError, match="one value and one output"):
        rotate_heads(model, ("re:.*v_proj$", "re:.*down_proj$"))
