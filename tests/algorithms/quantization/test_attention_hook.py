"""The attention hook: it sees the keys after the rotary embedding (checked against a hand-computed rotary of
k_proj's outputs), changes nothing without scales, touches neither the model's config nor other models, and
gives the same values with the KV cache on as off."""

from __future__ import annotations

import pytest
import torch

from layerwise.algorithms.quantization.attention import (
    AttentionError,
    attach,
    attention_state,
    detach,
    find_attention_modules,
    set_attention_scales,
)
from layerwise.algorithms.quantization.kv_cache import FP8_KV, kv_amax, kv_scale
from tests.conftest import build_tiny_llama


def hand_rotary_keys(model, ids: torch.Tensor) -> torch.Tensor:
    """Layer 0's keys from its k_proj, rotated by hand: RoPE with theta and head_dim from the config, the
    rotate-half layout (the first half of each head pairs with the second)."""
    config = model.config
    attention = model.model.layers[0].self_attn
    hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(ids))
    batch, tokens = ids.shape
    dim = attention.head_dim
    keys = attention.k_proj(hidden).view(batch, tokens, -1, dim).transpose(1, 2)
    theta = config.rope_parameters["rope_theta"]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    rotated = torch.cat([-keys[..., dim // 2:], keys[..., : dim // 2]], dim=-1)
    return keys * cos + rotated * sin


@torch.no_grad()
def test_the_hook_sees_the_keys_after_the_rotary_embedding():
    model = build_tiny_llama()
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    seen = {}
    modules = find_attention_modules(model)
    assert list(modules) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    handle = attach(modules["model.layers.0.self_attn"]).observe(lambda kind, states: seen.setdefault(kind, states))
    model(ids)
    handle.remove()
    expected = hand_rotary_keys(model, ids)
    assert seen["key"].shape == (2, 2, 9, 16) and seen["query"].shape == (2, 4, 9, 16)
    torch.testing.assert_close(seen["key"], expected, rtol=1e-5, atol=1e-5)
    attention = model.model.layers[0].self_attn
    unrotated = attention.k_proj(model.model.layers[0].input_layernorm(model.model.embed_tokens(ids)))
    assert not torch.allclose(seen["key"], unrotated.view(2, 9, 2, 16).transpose(1, 2), atol=1e-3)  # RoPE mattered


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@torch.no_grad()
def test_without_scales_the_hook_changes_nothing_and_detach_restores_the_module(implementation):
    model = build_tiny_llama(attn_implementation=implementation)
    other = build_tiny_llama(seed=1, attn_implementation=implementation)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    before, other_before = model(ids).logits, other(ids).logits
    modules = find_attention_modules(model)
    configs = {name: m.config for name, m in modules.items()}
    for name, module in modules.items():
        attach(module, name)
    assert torch.equal(model(ids).logits, before) and torch.equal(other(ids).logits, other_before)
    assert model.config._attn_implementation == implementation  # the model's config (masks, saving) untouched
    assert modules["model.layers.0.self_attn"].config._attn_implementation == f"layerwise_fp8|{implementation}"
    for module in modules.values():
        set_attention_scales(module, {"k_scale": torch.tensor([0.01]), "v_scale": torch.tensor([0.01])}, FP8_KV)
    assert not torch.equal(model(ids).logits, before)
    for name, module in modules.items():
        detach(module)
        assert module.config is configs[name] and "k_scale" not in module._buffers and attention_state(module) is None
    assert torch.equal(model(ids).logits, before)


@torch.no_grad()
def test_the_cache_path_quantizes_like_the_calibrated_forward():
    """Decoding with the KV cache on: the cached keys are FP8 values already, quantized again to themselves, so
    the next token's logits equal those of one forward over the whole sequence (cache off)."""
    model = build_tiny_llama()
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(2))
    amax = {}
    modules = find_attention_modules(model)
    for name, module in modules.items():
        attach(module, name).observe(lambda kind, s, n=name: amax.setdefault((n, kind), kv_amax(s, "attn_head")))
    model(ids)
    for name, module in modules.items():
        attention_state(module).observers.clear()
        set_attention_scales(module, {"k_scale": kv_scale(amax[name, "key"]) / 2,
                                      "v_scale": kv_scale(amax[name, "value"]) / 2}, FP8_KV.replace(strategy="attn_head"))
    whole = model(ids, use_cache=False).logits[:, -1]
    prefill = model(ids[:, :-1], use_cache=True)
    step = model(ids[:, -1:], cache=prefill.past_key_values, use_cache=True).logits[:, -1]
    torch.testing.assert_close(step, whole, rtol=1e-5, atol=1e-5)


def test_a_module_without_a_config_is_refused_naming_the_fix():
    module = torch.nn.Module()
    with pytest.raises(AttentionError, match=r"attention module 'x' \(Module\) has no config.*attention_modules"):
        attach(module, "x")


def test_a_patch_may_name_the_attention_classes():
    model = build_tiny_llama()
    assert list(find_attention_modules(model, ("LlamaAttention",))) == list(find_attention_modules(model))
    assert find_attention_modules(model, ("MistralAttention",)) == {}


@torch.no_grad()
def test_traced_inside_a_block_the_hook_is_one_opaque_call_that_reads_the_scales_at_replay():
    """A later run cutting inside the blocks (GPTQ at layers) traces through the attention module: the hook is
    recorded as one opaque call, so the replay quantizes with the scales the module holds when it runs."""
    import layerwise

    model = build_tiny_llama()
    modules = find_attention_modules(model)
    for module in modules.values():
        set_attention_scales(module, {"k_scale": torch.tensor([0.01]), "v_scale": torch.tensor([0.01])}, FP8_KV)
    inputs = {"input_ids": torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4))}
    result = layerwise.trace(model, inputs, sequential_targets=["LlamaMLP"])
    assert any(call.function.endswith("attention._dispatch") for call in result.opaque_calls)
    assert result.verify(inputs) == 0
    for module in modules.values():
        module.k_scale.fill_(0.02)  # changed after tracing: the replay follows
    assert result.verify(inputs) == 0
