"""qmath against a plain element-by-element reference, on seeded random weights."""

import math

import pytest
import torch

from layerwise.algorithms.quantization import slices
from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import (
    compute_qparams,
    dequantize,
    fake_quantize,
    fake_quantize_weight,
    fake_quantize_weight_with_codes,
    fake_quantize_weight_with_packed_codes,
    qrange,
    quantize,
    quantize_weight,
    weight_min_max,
    weight_qparams,
)
from layerwise.errors import RecipeError

ARGS = {
    "int4-sym-group": QuantizationArgs(4, True, "group", 32),
    "int4-asym-group": QuantizationArgs(4, False, "group", 32),
    "int4-sym-channel": QuantizationArgs(4, True, "channel", None),
    "int8-sym-channel": QuantizationArgs(8, True, "channel", None),
    "int8-asym-channel": QuantizationArgs(8, False, "channel", None),
    "int8-sym-tensor": QuantizationArgs(8, True, "tensor", None),
    "int4-asym-tensor": QuantizationArgs(4, False, "tensor", None),
}


def _round_half_even(v: float) -> float:
    return float(round(v))  # Python's round() is round-half-to-even, like torch.round


def reference_fake_quant(weight: torch.Tensor, args: QuantizationArgs):
    """Loop over every element: find its block, its range, its scale, round, clamp."""
    qmin, qmax = -(2 ** (args.num_bits - 1)), 2 ** (args.num_bits - 1) - 1
    out_f, in_f = weight.shape
    w = weight.tolist()

    def block_of(i, j):
        if args.strategy == "tensor":
            return [(r, c) for r in range(out_f) for c in range(in_f)]
        if args.strategy == "channel":
            return [(i, c) for c in range(in_f)]
        g = j // args.group_size
        return [(i, c) for c in range(g * args.group_size, (g + 1) * args.group_size)]

    cache, result, scales = {}, [[0.0] * in_f for _ in range(out_f)], {}
    for i in range(out_f):
        for j in range(in_f):
            key = (i if args.strategy != "tensor" else 0,
                   j // args.group_size if args.strategy == "group" else 0)
            if key not in cache:
                vals = [w[r][c] for r, c in block_of(i, j)]
                lo, hi = min(min(vals), 0.0), max(max(vals), 0.0)
                if args.symmetric:
                    scale = max(abs(lo), abs(hi)) / ((qmax - qmin) / 2)
                    zp = 0.0
                else:
                    scale = (hi - lo) / (qmax - qmin)
                    zp = _round_half_even(min(max(qmin - lo / scale, qmin), qmax))
                cache[key] = (scale, zp)
            scale, zp = cache[key]
            q = min(max(_round_half_even(w[i][j] / scale + zp), qmin), qmax)
            result[i][j] = (q - zp) * scale
            scales[key] = scale
    return torch.tensor(result, dtype=torch.float64), cache


@pytest.fixture
def weight():
    return torch.randn(6, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.1


def test_qrange():
    assert qrange(QuantizationArgs(num_bits=4)) == (-8, 7)
    assert qrange(QuantizationArgs(num_bits=8, strategy="channel")) == (-128, 127)


@pytest.mark.parametrize("slice_elements", [1 << 16, 64, 150])  # whole, a row a slice, two rows (the last one)
@pytest.mark.parametrize("name", ARGS)
def test_matches_loop_reference(name, weight, slice_elements, monkeypatch):
    monkeypatch.setattr(slices, "SLICE_ELEMENTS", slice_elements)  # the CPU works through slices of rows
    args = ARGS[name]
    scale, zp = weight_qparams(weight, args)
    fq = fake_quantize_weight(weight, scale, zp, args)
    expected, cache = reference_fake_quant(weight, args)
    torch.testing.assert_close(fq, expected, rtol=0, atol=1e-12)
    ref_scales = torch.tensor([cache[k][0] for k in sorted(cache)], dtype=torch.float64)
    torch.testing.assert_close(scale.flatten(), ref_scales, rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ARGS)
def test_shapes_follow_compressed_tensors(name, weight):
    args = ARGS[name]
    scale, zp = weight_qparams(weight, args)
    expected = {"tensor": (1,), "channel": (6, 1), "group": (6, 64 // (args.group_size or 1))}[args.strategy]
    assert tuple(scale.shape) == expected and tuple(zp.shape) == expected


@pytest.mark.parametrize("name", ARGS)
def test_round_trip_error_is_at_most_half_a_step(name, weight):
    args = ARGS[name]
    scale, zp = weight_qparams(weight, args)
    fq = fake_quantize_weight(weight, scale, zp, args)
    if args.strategy == "group":
        step = scale.repeat_interleave(args.group_size, dim=1)
    else:
        step = scale.expand_as(weight)
    assert torch.all((weight - fq).abs() <= step / 2 * (1 + 1e-9))


@pytest.mark.parametrize("name", ARGS)
def test_zero_point_integer_and_in_range(name, weight):
    args = ARGS[name]
    qmin, qmax = qrange(args)
    _, zp = weight_qparams(weight + 0.05, args)  # shifted: asymmetric zero points move off the middle
    assert torch.equal(zp, torch.round(zp))
    assert zp.min() >= qmin and zp.max() <= qmax
    if args.symmetric:
        assert torch.all(zp == 0)
    else:
        assert torch.any(zp != 0)


@pytest.mark.parametrize("name", ARGS)
def test_quantized_values_are_integers_in_range(name, weight):
    args = ARGS[name]
    qmin, qmax = qrange(args)
    scale, zp = weight_qparams(weight, args)
    from layerwise.algorithms.quantization.qmath import quantize_weight
    q = quantize_weight(weight, scale, zp, args)
    assert torch.equal(q, torch.round(q)) and q.min() >= qmin and q.max() <= qmax
    assert q.min() == qmin or q.max() == qmax  # the range is used


def test_scale_is_positive_for_zero_weights():
    for args in ARGS.values():
        scale, zp = weight_qparams(torch.zeros(4, 64), args)
        assert torch.all(scale > 0)
        fq = fake_quantize_weight(torch.zeros(4, 64), scale, zp, args)
        assert torch.all(fq == 0)


def test_elementwise_primitives():
    args = QuantizationArgs(num_bits=4, symmetric=False, strategy="tensor", group_size=None)
    scale, zp = compute_qparams(torch.tensor([-1.0]), torch.tensor([2.0]), args)
    assert math.isclose(scale.item(), 3 / 15, rel_tol=1e-6) and zp.item() == -3.0  # -8 - (-1 / 0.2) = -3
    x = torch.tensor([-1.0, 0.0, 0.3, 2.0, 5.0])
    q = quantize(x, scale, zp, args)
    assert q.tolist() == [-8.0, -3.0, -2.0, 7.0, 7.0]  # 5.0 clamps to qmax
    torch.testing.assert_close(dequantize(q, scale, zp), (q + 3) * scale)
    torch.testing.assert_close(fake_quantize(x, scale, zp, args), dequantize(q, scale, zp))


def test_g_idx_picks_the_group_of_each_column(weight):
    args = ARGS["int4-sym-group"]
    scale, zp = weight_qparams(weight, args)
    g_idx = torch.randint(0, 2, (64,), generator=torch.Generator().manual_seed(3))
    fq = fake_quantize_weight(weight, scale, zp, args, g_idx=g_idx)
    for j in range(64):
        col = fake_quantize(weight[:, j:j + 1], scale[:, g_idx[j]:g_idx[j] + 1], zp[:, g_idx[j]:g_idx[j] + 1], args)
        torch.testing.assert_close(fq[:, j:j + 1], col, rtol=0, atol=0)


def test_indivisible_group_is_an_error():
    with pytest.raises(ValueError, match="group_size 32 does not divide in_features 48"):
        weight_qparams(torch.randn(4, 48), ARGS["int4-sym-group"])


@pytest.mark.parametrize("fields, message", [
    ({"num_bits": 5}, "valid num_bits: 2, 3, 4, 8"),
    ({"strategy": "rows"}, "valid strategies: tensor, channel, group, block, token"),
    ({"strategy": "block"}, r"strategy 'block' needs block_structure \[rows, columns\]"),
    ({"type": "fp4"}, "valid types: int, float"),
    ({"type": "float", "num_bits": 2}, r"type .float. is float8 e4m3 \(num_bits 8\) or fp4 e2m1 \(num_bits 4\)"),
    ({"strategy": "group", "group_size": None}, "positive integer group_size"),
    ({"actorder": "dynamic"}, "valid actorders"),
])
def test_invalid_args_name_the_valid_values(fields, message):
    with pytest.raises(RecipeError, match=message):
        QuantizationArgs(**fields)


def test_float8_grid_equals_torchs_float8_round_trip():
    """The table lookup gives exactly what casting to float8 e4m3 and back gives: every code, the
    midpoints between neighbours (ties to even), values around the subnormals, NaN; in each dtype,
    in place, contiguous or not."""
    from layerwise.algorithms.quantization.qmath import float8_grid

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    finite = codes[torch.isfinite(codes)].sort().values
    x = torch.cat([torch.tensor([float("nan")]), finite, (finite[1:] + finite[:-1]) / 2, torch.randn(4096) * 100,
                   torch.randn(512) * 1e-3]).clamp(-448, 448)
    x = x[:x.numel() // 4 * 4].reshape(4, -1)  # 2-D, as weights are
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        values = x.to(dtype)
        expected = values.to(torch.float8_e4m3fn).to(dtype)
        got = float8_grid(values.clone())
        assert got.dtype == dtype and got.shape == values.shape
        in_place = values.clone()
        assert float8_grid(in_place).data_ptr() == in_place.data_ptr()
        transposed = values.t().clone().t()  # not contiguous: rounded in place all the same
        assert torch.equal(float8_grid(transposed).nan_to_num(7.0), expected.nan_to_num(7.0))
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
        assert bool(got.isnan().any()) == bool(values.isnan().any())


@pytest.mark.parametrize("symmetric", [True, False])
def test_group_quantization_broadcasts_the_scales_it_used_to_repeat(symmetric):
    """quantize_weight / fake_quantize_weight with groups broadcast each group's scale (and zero point) over its
    columns: the values of the per-column scales expand_qparams builds, element for element."""
    from layerwise.algorithms.quantization.args import QuantizationArgs
    from layerwise.algorithms.quantization.qmath import (
        expand_qparams,
        fake_quantize,
        fake_quantize_weight,
        quantize,
        quantize_weight,
        weight_qparams,
    )

    args = QuantizationArgs(num_bits=4, symmetric=symmetric, strategy="group", group_size=16)
    weight = torch.randn(24, 64, generator=torch.Generator().manual_seed(3))
    scale, zero = weight_qparams(weight, args)
    s, z = expand_qparams(weight, scale, zero, args)
    assert torch.equal(quantize_weight(weight, scale, zero, args), quantize(weight, s, z, args))
    assert torch.equal(fake_quantize_weight(weight, scale, zero, args), fake_quantize(weight, s, z, args))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_group_ranges_reduced_in_float32_slices_are_the_weights_own(dtype):
    torch.manual_seed(0)
    weight = torch.randn(300, 1024).to(dtype)  # more rows than a slice holds
    args = QuantizationArgs(4, True, "group", 32)
    low, high = weight_min_max(weight, args)
    groups = weight.reshape(300, 32, 32)
    assert low.dtype == high.dtype == dtype
    assert torch.equal(low, groups.amin(dim=-1)) and torch.equal(high, groups.amax(dim=-1))


def test_float8_codes_kept_with_the_fake_quantized_values():
    torch.manual_seed(0)
    weight = torch.randn(300, 512).to(torch.bfloat16)
    args = QuantizationArgs(8, True, "channel", type="float")
    scale, zero_point = weight_qparams(weight.float(), args)
    values, codes = fake_quantize_weight_with_codes(weight, scale, zero_point, args, torch.float8_e4m3fn)
    assert torch.equal(values, fake_quantize_weight(weight, scale, zero_point, args))
    assert torch.equal(codes.view(torch.uint8),
                       quantize_weight(weight, scale, zero_point, args).to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("slice_elements", [1 << 16, 64, 150])  # whole, a row a slice, slices ending mid-way
@pytest.mark.parametrize("args", [QuantizationArgs(4, True, "group", 32), QuantizationArgs(4, False, "group", 32),
                                  QuantizationArgs(4, True, "channel"), QuantizationArgs(4, False, "tensor")],
                         ids=["sym-group", "asym-group", "sym-channel", "asym-tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4_codes_packed_slice_by_slice_are_the_whole_weights_packing(args, dtype, slice_elements, monkeypatch):
    from layerwise.algorithms.quantization.int_packing import pack_to_int32

    monkeypatch.setattr(slices, "SLICE_ELEMENTS", slice_elements)
    torch.manual_seed(1)
    weight = (torch.randn(37, 96) * torch.randn(37, 96).exp()).to(dtype)
    scale, zero_point = weight_qparams(weight.float(), args)
    values, packed = fake_quantize_weight_with_packed_codes(weight, scale, zero_point, args)
    expected_values, codes = fake_quantize_weight_with_codes(weight, scale, zero_point, args, torch.int8)
    assert torch.equal(values, expected_values) and values.dtype == dtype
    assert packed.dtype == torch.int32 and torch.equal(packed, pack_to_int32(codes, 4))
    assert codes.min() == -8 and codes.max() == 7  # both ends of the range were packed
    if args.strategy != "group":  # a width of whole bytes but not whole words: the general packer's padding
        narrow = weight[:, :36].contiguous()
        scale, zero_point = weight_qparams(narrow.float(), args)
        values, packed = fake_quantize_weight_with_packed_codes(narrow, scale, zero_point, args)
        expected_values, codes = fake_quantize_weight_with_codes(narrow, scale, zero_point, args, torch.int8)
        assert torch.equal(values, expected_values) and torch.equal(packed, pack_to_int32(codes, 4))
