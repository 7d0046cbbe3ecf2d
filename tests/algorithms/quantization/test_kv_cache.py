"""The FP8 KV cache's numbers: E4M3 rounding of keys and values against a reference written from the format's
definition, the scale identity ``amax / 448`` per tensor and per head, and the settings that are refused."""

from __future__ import annotations

import math

import pytest
import torch

from layerwise.algorithms.quantization.kv_cache import (
    FP8_KV,
    fake_quantize_kv,
    kv_amax,
    kv_cache_args,
    kv_scale,
)
from layerwise.errors import RecipeError

HEAD = FP8_KV.replace(strategy="attn_head")


def e4m3_values() -> list[tuple[float, int]]:
    """Every finite non-negative E4M3 value with its mantissa bits: 1 sign, 4 exponent (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m / 8 * 2**-6); exponent 15 with mantissa 7 is NaN (no infinities)."""
    values = []
    for exponent in range(16):
        for mantissa in range(8):
            if exponent == 15 and mantissa == 7:
                continue
            value = (mantissa / 8) * 2.0 ** -6 if exponent == 0 else (1 + mantissa / 8) * 2.0 ** (exponent - 7)
            values.append((value, mantissa))
    return values


GRID = e4m3_values()


def reference_e4m3(x: float) -> float:
    """The nearest E4M3 value to ``x`` (saturating at +-448), a tie going to the value with an even mantissa."""
    magnitude = min(abs(x), 448.0)
    best = min(GRID, key=lambda vm: (abs(vm[0] - magnitude), vm[1] % 2))
    return math.copysign(best[0], x)


def test_the_reference_grid_is_e4m3():
    assert max(v for v, _ in GRID) == 448.0 and len({v for v, _ in GRID}) == 127  # +0 and 126 positives
    assert reference_e4m3(1.0625) == 1.0 and reference_e4m3(1.1875) == 1.25  # ties to the even mantissa


def test_keys_round_to_the_nearest_e4m3_value_with_the_head_scales():
    torch.manual_seed(0)
    keys = torch.randn(2, 3, 4, 8) * torch.tensor([0.1, 1.0, 30.0]).reshape(1, 3, 1, 1)
    keys[0, 0, 0, 0] = 1e6  # beyond the range: saturates
    scale = kv_scale(kv_amax(keys, "attn_head")) / 4  # a smaller scale than calibrated: many saturate
    got = fake_quantize_kv(keys, scale, HEAD)
    expected = torch.tensor([reference_e4m3(v / s) * s for v, s in
                             zip(keys.flatten().tolist(), scale.expand(3, 4, 8).expand(2, 3, 4, 8).flatten().tolist())])
    assert torch.equal(got.flatten(), expected.to(torch.float32))
    assert got.abs().amax() == 448 * scale.max()


def test_values_round_per_tensor_and_keep_their_dtype():
    torch.manual_seed(1)
    values = (torch.randn(1, 2, 5, 4) * 3).to(torch.bfloat16)
    scale = kv_scale(kv_amax(values, "tensor"), torch.bfloat16)
    got = fake_quantize_kv(values, scale, FP8_KV)
    s = float(scale)
    expected = torch.tensor([reference_e4m3(v / s) * s for v in values.float().flatten().tolist()])
    assert got.dtype == torch.bfloat16 and torch.equal(got.float().flatten(), expected.to(torch.bfloat16).float())


def test_scale_is_amax_over_448_per_tensor_and_per_head():
    torch.manual_seed(2)
    keys = torch.randn(3, 2, 7, 4)
    assert torch.equal(kv_scale(kv_amax(keys, "tensor")), (keys.abs().max() / 448).reshape(1))
    per_head = kv_scale(kv_amax(keys, "attn_head"))
    assert per_head.shape == (2, 1, 1)
    for head in range(2):
        assert per_head[head, 0, 0] == keys[:, head].abs().max() / 448
    # the largest key lands on 448 exactly: nothing calibrated saturates
    assert fake_quantize_kv(keys, per_head, HEAD).abs().amax(dim=(0, 2, 3)).tolist() == pytest.approx(
        keys.abs().amax(dim=(0, 2, 3)).tolist(), rel=0)


def test_an_all_zero_range_gets_a_positive_scale():
    scale = kv_scale(kv_amax(torch.zeros(1, 2, 3, 4), "attn_head"))
    assert (scale > 0).all() and torch.equal(fake_quantize_kv(torch.zeros(1, 2, 3, 4), scale, HEAD),
                                             torch.zeros(1, 2, 3, 4))


def test_recipe_values_read_as_fp8_per_tensor_or_head():
    assert kv_cache_args("fp8") == FP8_KV and kv_cache_args("FP8_HEAD") == HEAD
    assert kv_cache_args({"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False,
                          "symmetric": True}) == HEAD
    assert kv_cache_args({"num_bits": 8}) == FP8_KV  # llm-compressor's shortest form
    assert kv_cache_args(None) is None
    from compressed_tensors.quantization import QuantizationArgs as CTArgs

    assert kv_cache_args(CTArgs(num_bits=8, type="float", strategy="tensor", dynamic=False)) == FP8_KV


@pytest.mark.parametrize("value, message", [
    ({"num_bits": 8, "type": "int"}, r"x\.kv_cache_scheme: the KV cache is stored as FP8 E4M3 \(type: float"),
    ({"num_bits": 4, "type": "float", "strategy": "tensor"}, "FP8 E4M3"),
    ({"num_bits": 8, "dynamic": True}, "dynamic: True is not served.*set dynamic: false"),
    ({"num_bits": 8, "symmetric": False}, "symmetric: False is not served.*set symmetric: true"),
    ({"num_bits": 8, "strategy": "channel"}, "strategy 'channel' is not a KV cache strategy; valid: tensor, attn_head"),
    ({"num_bits": 8, "observer": "mse"}, "observer 'mse'.*leave observer out"),
    ({"num_bits": 8, "bits": 8}, r"unknown field\(s\) 'bits'"),
    ("int8", "unknown name 'int8'; give 'fp8'"),
    (8, "must be 'fp8', 'fp8_head' or a mapping"),
])
def test_unsupported_kv_schemes_are_refused_naming_the_field_and_the_fix(value, message):
    with pytest.raises(RecipeError, match=message):
        kv_cache_args(value, "x.kv_cache_scheme")
