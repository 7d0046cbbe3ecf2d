"""FP4 E2M1, E8M0 (MX) and NVFP4 numerics against plain references written from the formats' definitions
(OCP MX v1.0; NVFP4: E2M1 in blocks of 16, an FP8 E4M3 scale each, one FP32 global scale per tensor)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from layerwise.algorithms.quantization import slices
from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.float_formats import (
    FP8_TINY,
    e8m0_codes,
    e8m0_values,
    fake_quantize_nvfp4,
    fp4_codes,
    fp4_grid,
    mx_scale,
    nvfp4_block_scales,
    nvfp4_global_scale,
    pack_fp4,
    unpack_fp4,
)
from layerwise.algorithms.quantization.global_scales import fused_groups, global_scales
from layerwise.algorithms.quantization.presets import PRESETS
from layerwise.algorithms.quantization.qmath import (
    compute_qparams,
    fake_quantize,
    fake_quantize_weight,
    weight_qparams,
)
from layerwise.errors import RecipeError

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
NVFP4 = PRESETS["NVFP4A16"].weights
MXFP4 = PRESETS["MXFP4A16"].weights
MXFP8 = PRESETS["MXFP8A16"].weights


def reference_fp4(value: float) -> float:
    """Nearest signed E2M1 value; at a tie the even code (even magnitude index); beyond 6 saturates."""
    magnitude = min(abs(value), 6.0)
    distances = [abs(magnitude - m) for m in MAGNITUDES]
    best = min(distances)
    index = [i for i, d in enumerate(distances) if d == best]
    index = next(i for i in index if i % 2 == 0) if len(index) > 1 else index[0]
    return math.copysign(MAGNITUDES[index], value)


def test_fp4_rounding_is_nearest_ties_to_even_and_saturates():
    midpoints = [(a + b) / 2 for a, b in itertools.pairwise(MAGNITUDES)]
    values = sorted({*MAGNITUDES, *midpoints, *(m + 1e-3 for m in midpoints), *(m - 1e-3 for m in midpoints),
                     6.5, 7.0, 100.0, 1e30, 0.1, 0.26, 2.49, 4.9})
    values += [-v for v in values]
    values += torch.empty(500).uniform_(-8, 8, generator=torch.Generator().manual_seed(0)).tolist()
    got = fp4_grid(torch.tensor(values, dtype=torch.float64)).tolist()
    assert got == [reference_fp4(v) for v in values]
    # float32 takes another path (the step from the exponent bits): subnormals, binade edges, the largest float
    tiny = torch.finfo(torch.float32).tiny
    singles = torch.tensor(values + [tiny, tiny / 8, 1.9999999, 3.9999998, 5.9999995, 3.4e38, 0.0], dtype=torch.float32)
    singles = torch.cat([singles, -singles])
    got = fp4_grid(singles.clone())
    assert got.tolist() == [reference_fp4(v) for v in singles.tolist()]
    assert torch.equal(torch.signbit(got), torch.signbit(singles))
    # spot checks straight from the definition
    assert fp4_grid(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == [0, 1, 1, 2, 2, 4, 4]
    assert torch.signbit(fp4_grid(torch.tensor([-0.1]))).item()  # a small negative rounds to -0


@pytest.mark.parametrize("slice_elements", [1 << 16, 4])
def test_fp4_codes_sign_bit_and_packing_layout(slice_elements, monkeypatch):
    monkeypatch.setattr(slices, "SLICE_ELEMENTS", slice_elements)
    codes = fp4_codes(torch.tensor([[0.5, -6.0, 1.0, -0.0]]))
    assert codes.tolist() == [[1, 15, 2, 8]]
    # every code from its value (the magnitude index in bits 0-2, the sign in bit 3), rounded first or not
    values = torch.tensor([*MAGNITUDES, *(-m for m in MAGNITUDES)]).reshape(4, 4)
    assert fp4_codes(values, on_grid=True).flatten().tolist() == list(range(16))
    assert fp4_codes(values * 1.1, on_grid=False).flatten().tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,
                                                                         14, 15]
    assert torch.equal(fp4_codes(values.to(torch.float64) * 0.97), fp4_codes(values, on_grid=True))
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0xF1, 0x02]]  # column 2k low nibble, 2k+1 high
    assert unpack_fp4(packed).tolist() == [[1, 15, 2, 0]]  # -0 is stored as +0
    with pytest.raises(ValueError, match="even number of columns"):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))


def reference_mx_scale(amax: float, emax: int) -> float:
    if amax == 0:
        return 2.0 ** -127
    exponent = math.floor(math.log2(amax))
    if amax / 2.0 ** exponent >= 1.75:  # the block's max would saturate: one binade up
        exponent += 1
    return 2.0 ** max(-127, min(127, exponent - emax))


@pytest.mark.parametrize("bits,emax,element_max", [(4, 2, 6.0), (8, 8, 448.0)])
def test_mx_scale_is_the_ocp_power_of_two(bits, emax, element_max):
    amax = torch.cat([torch.tensor([0.0, 1.0, 1.5, 1.74, 1.75, 1.99, 6.0, 448.0, 2.0 ** -140]),
                      torch.empty(300).uniform_(0, 20, generator=torch.Generator().manual_seed(1)),
                      torch.empty(50).uniform_(1e-6, 1e-3, generator=torch.Generator().manual_seed(2))])
    scale = mx_scale(amax, bits)
    assert scale.tolist() == [reference_mx_scale(a, emax) for a in amax.tolist()]
    nonzero = amax > 2.0 ** -100
    assert (amax[nonzero] / scale[nonzero]).max() < 7.0 if bits == 4 else (amax / scale).max() < element_max
    codes = e8m0_codes(scale)
    assert codes.dtype == torch.uint8 and torch.equal(e8m0_values(codes), scale)
    assert e8m0_codes(torch.tensor([1.0, 0.5, 2.0 ** -127])).tolist() == [127, 126, 0]


def test_e8m0_refuses_a_scale_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        e8m0_codes(torch.tensor([0.75]))


@pytest.mark.parametrize("slice_elements", [1 << 16, 64])  # whole, or the CPU's slices of rows
def test_nvfp4_scales_follow_the_definition(slice_elements, monkeypatch):
    monkeypatch.setattr(slices, "SLICE_ELEMENTS", slice_elements)
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(3))
    weight[0, :16] = 0.0  # an all-zero block
    weight[1, :16] = 1e-9  # a block whose fp8 scale underflows
    amax = weight.abs().amax()
    g = nvfp4_global_scale(amax)
    assert g.dtype == torch.float32 and g.shape == (1,) and g.item() == pytest.approx(448 * 6 / amax.item(), rel=1e-7)
    scale, zero = weight_qparams(weight, NVFP4, global_scale=g)
    assert scale.shape == (8, 4) and not zero.any()
    blocks = weight.abs().reshape(8, 4, 16).amax(dim=-1)
    s8 = (g * blocks / 6).to(torch.float8_e4m3fn).to(torch.float32)
    s8 = torch.where(s8 == 0, torch.full_like(s8, FP8_TINY), s8)
    assert torch.equal(scale, s8 / g)
    assert torch.equal(nvfp4_block_scales(scale, g).to(torch.float32), s8)  # the stored bytes come back exactly
    assert nvfp4_block_scales(scale, g).to(torch.float32).max() <= 448
    # fake quantization: each value onto the E2M1 grid of its block's effective scale
    fq = fake_quantize_weight(weight, scale, zero, NVFP4)
    expanded = scale.repeat_interleave(16, dim=1)
    expected = torch.tensor([reference_fp4(v) for v in (weight / expanded).reshape(-1).tolist()]).reshape(8, 64)
    assert torch.equal(fq, expected * expanded)
    assert nvfp4_global_scale(torch.tensor(0.0)).item() == 1.0


def _nvfp4_inputs_by_the_general_path(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Each block's range, compute_qparams' block scales, fake_quantize: the path fake_quantize_nvfp4 replaces."""
    args = PRESETS["NVFP4"].input_activations
    blocks = x.reshape(*x.shape[:-1], -1, 16)
    scale, zero = compute_qparams(blocks.amin(dim=-1, keepdim=True), blocks.amax(dim=-1, keepdim=True), args,
                                  global_scale)
    return fake_quantize(blocks, scale, zero, args).reshape(x.shape)


def _awkward_nvfp4_inputs() -> torch.Tensor:
    """The first rows: blocks whose scale is exactly 1 or 1/2 (a 6 or 3 in them, global scale 1) holding every E2M1 midpoint,
    a float32 step either side of it, and every grid value, with both signs; all-zero, -0.0, underflowing,
    subnormal and huge blocks; and random ones over twelve orders of magnitude."""
    midpoints = [(a + b) / 2 for a, b in itertools.pairwise(MAGNITUDES)]
    near = [torch.nextafter(torch.tensor(m), torch.tensor(d)).item() for m in midpoints for d in (0.0, 10.0)]
    values = torch.tensor([*midpoints, *near, *MAGNITUDES, 0.1, 0.26, 5.9999995])
    values = torch.cat([values, -values])
    values = torch.cat([values, values.new_zeros(-len(values) % 60)]).reshape(-1, 15)  # 4 blocks a row
    top = torch.where(torch.arange(len(values)) % 2 == 0, 6.0, -6.0).reshape(-1, 1)
    exact = torch.cat([torch.cat([values, top], dim=1), torch.cat([values / 2, top / 2], dim=1)])
    gen = torch.Generator().manual_seed(6)
    random = torch.randn(40, 16, generator=gen) * torch.logspace(-6, 6, 40).reshape(-1, 1)
    special = torch.zeros(8, 16)
    special[1] = -0.0
    special[2, :3] = torch.tensor([-1e-30, 1e-30, -0.0])  # underflows to the smallest FP8 scale
    special[3] = torch.finfo(torch.float32).tiny / 4  # subnormal
    special[4, 0], special[4, 1:] = 3e38, -1e-3
    special[5] = torch.linspace(-6.5, 6.5, 16)
    special[6] = torch.linspace(-1.0, 1.0, 16) * 1e-8
    special[7] = torch.linspace(-7.0, 7.0, 16)
    return torch.cat([exact, random, special]).reshape(-1, 64)


@pytest.mark.parametrize("slice_elements", [1 << 18, 64])  # one slice, or several
def test_nvfp4_input_fake_quantization_is_the_general_path_bit_for_bit(slice_elements, monkeypatch):
    monkeypatch.setattr("layerwise.algorithms.quantization.float_formats.INPUT_SLICE_ELEMENTS", slice_elements)
    x = _awkward_nvfp4_inputs()
    exact = x[:4].reshape(-1, 16)  # 120 values, 16 blocks
    for global_scale in (torch.tensor([1.0]), nvfp4_global_scale(exact.abs().amax()), torch.tensor([37.5])):
        got = fake_quantize_nvfp4(x, global_scale)
        expected = _nvfp4_inputs_by_the_general_path(x, global_scale)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32))  # the signs of zeros too
    # with global scale 1 the first blocks' scales are 1 and 1/2: their values straight from the definition
    scale = exact.abs().amax(dim=-1, keepdim=True) / 6
    assert scale.unique().tolist() == [0.5, 1.0]
    reference = torch.tensor([reference_fp4(v) for v in (exact / scale).reshape(-1).tolist()]).reshape(exact.shape)
    assert torch.equal(fake_quantize_nvfp4(x[:4], torch.tensor([1.0])).reshape(exact.shape), reference * scale)
    # any leading shape; a width the blocks do not divide and non-finite values are refused
    y = x.reshape(2, -1, 64)
    assert torch.equal(fake_quantize_nvfp4(y, torch.tensor([2.0])), fake_quantize_nvfp4(x, torch.tensor([2.0])).reshape(y.shape))
    assert fake_quantize_nvfp4(torch.randn(0, 5, 64), torch.tensor([1.0])).shape == (0, 5, 64)  # no tokens
    with pytest.raises(ValueError, match="do not divide 40"):
        fake_quantize_nvfp4(torch.randn(3, 40), torch.tensor([1.0]))
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = x.clone()
        broken[7, 33] = bad
        with pytest.raises(ValueError, match="NaN or inf"):
            fake_quantize_nvfp4(broken, torch.tensor([1.0]))


@pytest.mark.parametrize("slice_elements", [1 << 16, 64])  # whole, or the CPU's slices of rows
def test_mx_fake_quantization_follows_the_definition(slice_elements, monkeypatch):
    monkeypatch.setattr(slices, "SLICE_ELEMENTS", slice_elements)
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(4)) * 3
    scale, _ = weight_qparams(weight, MXFP4)
    assert scale.shape == (4, 2)
    blocks = weight.abs().reshape(4, 2, 32).amax(dim=-1)
    assert scale.tolist() == [[reference_mx_scale(a, 2) for a in row] for row in blocks.tolist()]
    fq = fake_quantize_weight(weight, scale, None, MXFP4)
    expanded = scale.repeat_interleave(32, dim=1)
    expected = torch.tensor([reference_fp4(v) for v in (weight / expanded).reshape(-1).tolist()]).reshape(4, 64)
    assert torch.equal(fq, expected * expanded)
    scale8, _ = weight_qparams(weight, MXFP8)
    fq8 = fake_quantize_weight(weight, scale8, None, MXFP8)
    expanded8 = scale8.repeat_interleave(32, dim=1)
    assert torch.equal(fq8, (weight / expanded8).to(torch.float8_e4m3fn).to(torch.float32) * expanded8)


@pytest.mark.parametrize("args", [NVFP4, MXFP4, MXFP8])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(args, bad):
    weight = torch.randn(4, 64)
    weight[2, 5] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        weight_qparams(weight, args)


def test_fused_projections_share_the_smallest_global_scale():
    gen = torch.Generator().manual_seed(5)
    weights = {f"layers.0.self_attn.{p}": torch.randn(16, 32, generator=gen) * (i + 1)
               for i, p in enumerate(("q_proj", "k_proj", "v_proj", "o_proj"))}
    weights.update({f"layers.0.mlp.{p}": torch.randn(16, 32, generator=gen) for p in ("gate_proj", "up_proj")})
    assert fused_groups(list(weights)) == [[f"layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
                                           ["layers.0.self_attn.o_proj"],
                                           ["layers.0.mlp.gate_proj", "layers.0.mlp.up_proj"]]
    scales = global_scales(weights, NVFP4)
    qkv = [scales[f"layers.0.self_attn.{p}"] for p in ("q_proj", "k_proj", "v_proj")]
    own = [nvfp4_global_scale(weights[f"layers.0.self_attn.{p}"].abs().amax()) for p in ("q_proj", "k_proj", "v_proj")]
    assert all(torch.equal(s, qkv[0]) for s in qkv) and torch.equal(qkv[0], torch.stack(own).amin(dim=0))
    assert torch.equal(scales["layers.0.self_attn.o_proj"], nvfp4_global_scale(weights["layers.0.self_attn.o_proj"].abs().amax()))
    assert torch.equal(scales["layers.0.mlp.gate_proj"], scales["layers.0.mlp.up_proj"])
    assert global_scales(weights, MXFP4) == {}


def test_float_layouts_validate_and_name_the_fix():
    assert NVFP4.float_format == "nvfp4" and NVFP4.scale_dtype == "float8_e4m3fn"
    assert MXFP4.float_format == "mxfp4" and MXFP8.float_format == "mxfp8"
    assert QuantizationArgs.from_dict({"type": "float", "num_bits": 8, "strategy": "group", "group_size": 32,
                                       "scale_dtype": "uint8"}) == MXFP8  # compressed-tensors' spelling
    assert QuantizationArgs(type="float", num_bits=4, strategy="group", group_size=32) == MXFP4  # fp4 infers e8m0
    with pytest.raises(RecipeError, match="group_size 16"):
        QuantizationArgs(type="float", num_bits=4, strategy="tensor_group", group_size=32)
    with pytest.raises(RecipeError, match="group_size 32"):
        QuantizationArgs(type="float", num_bits=4, strategy="group", group_size=128)
    with pytest.raises(RecipeError, match="tensor_group"):
        QuantizationArgs(type="float", num_bits=4, strategy="channel", group_size=None)
    with pytest.raises(RecipeError, match="NVFP4"):
        QuantizationArgs(type="int", num_bits=4, strategy="tensor_group", group_size=16)
    with pytest.raises(RecipeError, match="e8m0"):
        QuantizationArgs(type="float", num_bits=8, strategy="group", group_size=128, scale_dtype="e8m0")
    with pytest.raises(RecipeError, match="unknown scale_dtype"):
        QuantizationArgs(type="float", num_bits=8, strategy="group", group_size=32, scale_dtype="float16")
    with pytest.raises(RecipeError, match="group_size 32"):
        MXFP4.replace(group_size=64)
    with pytest.raises(ValueError, match="in_features 40"):
        weight_qparams(torch.randn(4, 40), NVFP4)


@pytest.mark.parametrize("preset", ["NVFP4A16", "MXFP4A16", "MXFP8A16", "W4AFP8"])
def test_compressed_tensors_presets_read_as_ours(preset):
    """An llm-compressor config group written as compressed-tensors' preset is layerwise's preset."""
    from compressed_tensors.quantization import preset_name_to_scheme

    from layerwise.algorithms.quantization.config_groups import ct_args

    theirs = preset_name_to_scheme(preset, ["Linear"]).model_dump(mode="json")
    assert ct_args(theirs["weights"], "w", "weights") == PRESETS[preset].weights
    if theirs["input_activations"] is not None:
        ours = PRESETS[preset].input_activations
        assert ct_args(theirs["input_activations"], "a", "input_activations").replace(observer=ours.observer) == ours
