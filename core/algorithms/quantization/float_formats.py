"""The low-bit float formats Blackwell-class GPUs run: FP4 E2M1 values, E8M0 and FP8 block scales.

Definitions (OCP Microscaling Formats v1.0 for MX; NVIDIA's NVFP4)::

    FP4 E2M1 values      +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}      (1 sign, 2 exponent, 1 mantissa bit)
    MXFP4 / MXFP8        blocks of 32 values share one power-of-two scale 2**e, stored as the
                         E8M0 byte e + 127; elements are FP4 E2M1 (MXFP4) or FP8 E4M3 (MXFP8)
    NVFP4                blocks of 16 FP4 values share one FP8 E4M3 scale s8; the tensor has one
                         FP32 global scale g; a value decodes as q * s8 / g

Rounding onto a grid is to the nearest value, ties to the even code (the one whose mantissa
bit is 0), and saturates: anything beyond the largest value becomes it (+-6 for FP4).

Why the scales are what they are:

* **E8M0 (MX)**: the OCP scale is ``2**(floor(log2(amax)) - emax)`` with ``emax`` the element
  format's largest exponent (2 for E2M1, 8 for E4M3), so the block's largest value lands in
  the element's top binade. When ``amax``'s mantissa is 1.75 or more it would land at 7+ (FP4)
  or at or above 448 (E4M3) and saturate; there the exponent is raised by one, which loses
  less (compressed-tensors / vLLM make the same choice, so the scales agree with theirs).
* **NVFP4 global scale**: ``g = 448 * 6 / amax(tensor)``; then every block's scale
  ``g * amax(block) / 6`` is at most 448, so the FP8 block scales use E4M3's whole range
  instead of underflowing for a small tensor. vLLM runs q/k/v (and gate/up) as one fused
  matrix with one global scale, so those layers share the smallest ``g`` of the group.
* **NVFP4 block scale**: ``s8 = fp8(g * amax(block) / 6)``; a block so small that this rounds
  to 0 takes the smallest FP8 value instead (any positive scale decodes zeros; the smallest
  keeps the block's values instead of flushing them).

In memory layerwise keeps the *effective* float32 scale (``2**e`` or ``s8 / g``), so the
arithmetic of :mod:`.qmath` applies unchanged; the saver recovers the stored bytes exactly
(:func:`e8m0_codes`, :func:`nvfp4_block_scales`).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from layerwise.algorithms.quantization.slices import INPUT_SLICE_ELEMENTS, by_row_slices, row_slices
from layerwise.common.device_caches import device_cache

#: the non-negative FP4 E2M1 values, by code (the sign is bit 3 of a code)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
#: the smallest positive FP8 E4M3 value (a subnormal, 2**-9)
FP8_TINY = 2.0 ** -9
#: the largest element exponent of each MX element width (E2M1: 6 = 1.5 * 2**2; E4M3: 448 = 1.75 * 2**8)
MX_ELEMENT_EMAX = {4: 2, 8: 8}
#: MX blocks hold 32 elements, NVFP4 blocks 16
MX_BLOCK = 32
NVFP4_BLOCK = 16
E8M0_BIAS = 127


def check_finite(x: Tensor, what: str) -> None:
    """Refuse NaN / inf: a scale computed from them would be NaN and silently zero the layer."""
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} holds NaN or inf values; a low-bit float scale cannot be computed from them. "
                         f"Check the model's weights (or the calibration run) for overflow")


def fp4_grid(x: Tensor) -> Tensor:
    """``x`` rounded to the nearest FP4 E2M1 value (ties to the even code, saturating at +-6), in ``x``'s dtype.

    Within each binade E2M1 values are evenly spaced (0.5 below 2, 1 in [2, 4), 2 in [4, 6]) and the
    codes count up with them, so rounding ``|x| / step`` half to even is the nearest value with ties
    to the even code; the sign is copied back (a small negative rounds to ``-0.0``). For float32 the
    step, a power of two, is built from the exponent bits (half the binade's power, kept within
    [0.5, 2]): four integer passes where comparisons and a boolean sum took three times as long.
    """
    magnitude = x.abs().clamp_(max=FP4_MAX)
    if magnitude.dtype == torch.float32:
        exponent = magnitude.view(torch.int32) >> 23  # the biased exponent (the sign bit is 0)
        step = exponent.clamp_(127, 129).sub_(1).bitwise_left_shift_(23).view(torch.float32)
    else:
        step = (magnitude >= 2).to(magnitude.dtype).add_(magnitude >= 4, alpha=2).mul_(0.5).add_(0.5)  # 0.5, 1, 2
    return magnitude.div_(step).round_().mul_(step).copysign_(x)


def fp4_codes(x: Tensor, on_grid: bool = False) -> Tensor:
    """The 4-bit E2M1 codes (uint8, 0..15: sign bit 3, magnitude index bits 0-2) of the nearest E2M1 value to
    each element of ``x`` (:func:`fp4_grid`); the sign of a zero is kept. ``on_grid``: ``x`` holds E2M1 values
    already (the rounding is skipped).

    The sixteen E2M1 values differ in a float32's top ten bits (sign, exponent, first mantissa bit), so
    those bits index a table of codes: a shift, a mask and a lookup, in slices of rows on the CPU.
    """
    if x.ndim == 0:
        return fp4_codes(x.reshape(1), on_grid).reshape(())
    return by_row_slices(lambda part: _codes_of_values(part if on_grid else fp4_grid(part)),
                         x.to(torch.float32) if on_grid else x)


def _codes_of_values(values: Tensor) -> Tensor:
    top = values.to(torch.float32).contiguous().view(torch.int32).bitwise_right_shift(_TOP_BITS).bitwise_and_(0x3FF)
    return _top_bits_to_code(values.device).index_select(0, top.reshape(-1)).reshape(values.shape)


#: a float32's bits above the first mantissa bit (sign, exponent, that bit): 32 - 22
_TOP_BITS = 22


@device_cache()
def _top_bits_to_code(device: torch.device) -> Tensor:
    """E2M1 code by the top ten bits of its value as a float32 (other entries: never read)."""
    table = torch.zeros(1 << 10, dtype=torch.uint8)
    for code, value in enumerate(FP4_VALUES + tuple(-v for v in FP4_VALUES)):
        top = torch.tensor([value if code != 8 else -0.0], dtype=torch.float32).view(torch.int32).item()
        table[(top >> _TOP_BITS) & 0x3FF] = code
    return table.to(device)


def fp4_values(codes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """The values of E2M1 ``codes`` (see :func:`fp4_codes`) in ``dtype``."""
    table = torch.tensor(FP4_VALUES + tuple(-v for v in FP4_VALUES), dtype=dtype, device=codes.device)
    return table[codes.to(torch.long)]


def pack_fp4(codes: Tensor) -> Tensor:
    """``(rows, columns)`` E2M1 codes as ``(rows, columns / 2)`` bytes: column ``2k`` in the low nibble,
    ``2k + 1`` in the high one (the compressed-tensors / vLLM layout). Zero is stored as code 0 whatever
    its sign (compressed-tensors writes a stored ``-0.0`` so; both decode to 0)."""
    if codes.ndim != 2 or codes.shape[1] % 2:
        raise ValueError(f"FP4 packing needs a 2-D tensor with an even number of columns, got {tuple(codes.shape)}")
    codes = codes.to(torch.uint8)
    codes = torch.where(codes == 8, torch.zeros_like(codes), codes)
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """The E2M1 codes of :func:`pack_fp4`'s bytes, ``(rows, 2 * bytes)``."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def float8_grid(x: Tensor, codes: Tensor | None = None) -> Tensor:
    """``x`` (within +-448) rounded in place to float8 e4m3 values (nearest, ties to even); returns ``x``.
    ``codes``: ``x`` cast to float8 already (whatever ``x`` holds then: it is only written).

    On the CPU torch converts float8 back one element at a time (6 ms for 3.5 M values on 2
    cores); looking each code's value up in a 256-entry table gives the same values in 2.5 ms.
    The lookup writes into ``x`` itself: a fresh output of a weight's size would cost as much
    again in page faults as the lookup (MiniLM's Linears: 17 ms in place, 34 ms into a new tensor).
    """
    codes = x.to(torch.float8_e4m3fn) if codes is None else codes
    if x.device.type != "cpu":
        return x.copy_(codes)
    index = codes.view(torch.uint8).reshape(-1).to(torch.int32)
    table = _float8_values(x.dtype)
    if x.is_contiguous():
        torch.index_select(table, 0, index, out=x.view(-1))
        return x
    return x.copy_(table.index_select(0, index).view(x.shape))


@functools.cache
def _float8_values(dtype: torch.dtype) -> Tensor:
    """The value of every float8 e4m3 code (the index is the code's bits), in ``dtype``."""
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(dtype)


# -- E8M0 (MX) scales -----------------------------------------------------------------------
def mx_scale(amax: Tensor, num_bits: int) -> Tensor:
    """The power-of-two MX scale (float32) of blocks whose largest magnitudes are ``amax``, for elements
    of ``num_bits`` (4: E2M1, 8: E4M3); see the module docstring. An all-zero block gets ``2**-127``
    (any scale decodes zeros)."""
    check_finite(amax, "a block's range")
    amax = amax.to(torch.float32)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - 1 + (mantissa >= 0.875).to(exponent.dtype)  # mantissa 1.75 in [1, 2) terms
    exponent = torch.where(amax > 0, exponent - MX_ELEMENT_EMAX[num_bits], torch.full_like(exponent, -E8M0_BIAS))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    return torch.ldexp(torch.ones_like(amax), exponent)


def e8m0_codes(scale: Tensor) -> Tensor:
    """Power-of-two ``scale`` values as their E8M0 bytes (uint8, ``log2(scale) + 127``); an error if one is
    not a power of two in the E8M0 range (such a scale did not come from :func:`mx_scale`)."""
    mantissa, exponent = torch.frexp(scale.to(torch.float32))
    codes = exponent.to(torch.int32) - 1 + E8M0_BIAS
    if not bool(((mantissa == 0.5) & (codes >= 0) & (codes <= 254)).all()):
        raise ValueError("an MX scale is not a power of two within 2**-127 .. 2**127; it cannot be stored as E8M0")
    return codes.to(torch.uint8)


def e8m0_values(codes: Tensor) -> Tensor:
    """The float32 scales of E8M0 bytes."""
    return torch.ldexp(torch.ones(codes.shape, dtype=torch.float32, device=codes.device),
                       codes.to(torch.int32) - E8M0_BIAS)


# -- NVFP4 scales ---------------------------------------------------------------------------
def nvfp4_global_scale(amax: Tensor) -> Tensor:
    """The FP32 global scale ``448 * 6 / amax`` (shape ``(1,)``) of a tensor whose largest magnitude is
    ``amax``; ``1`` for an all-zero tensor."""
    check_finite(amax, "a tensor's range")
    amax = amax.to(torch.float32).reshape(1)
    return torch.where(amax > 0, (FP8_MAX * FP4_MAX) / amax.clamp_min(torch.finfo(torch.float32).tiny),
                       torch.ones_like(amax))


def nvfp4_scale(amax: Tensor, global_scale: Tensor) -> Tensor:
    """The effective float32 scales ``s8 / g`` of blocks with largest magnitudes ``amax``; ``s8`` is
    ``g * amax / 6`` rounded to FP8 E4M3 (the smallest FP8 value where that is 0)."""
    check_finite(amax, "a block's range")
    global_scale = global_scale.to(device=amax.device, dtype=torch.float32)
    s8 = float8_grid(torch.mul(global_scale, amax.to(torch.float32)).div_(FP4_MAX).clamp_(max=FP8_MAX))
    return s8.clamp_(min=FP8_TINY).div_(global_scale)  # s8 is 0 or at least FP8_TINY: the clamp replaces only 0


def nvfp4_block_scales(scale: Tensor, global_scale: Tensor) -> Tensor:
    """The FP8 E4M3 block scales ``s8`` stored for effective scales ``scale = s8 / g``: ``scale * g`` is
    within a float32 rounding of ``s8``, far less than half an FP8 step, so the cast gives ``s8`` back."""
    return (scale.to(torch.float32) * global_scale.to(device=scale.device, dtype=torch.float32)).to(
        torch.float8_e4m3fn)


def fake_quantize_nvfp4(x: Tensor, global_scale: Tensor) -> Tensor:
    """float32 ``x`` (``(..., channels)``, channels a multiple of 16) fake-quantized to NVFP4 with block scales from
    ``x`` itself over ``global_scale``: a quantized layer's input at run time.

    The values of the general path (each block's range, :func:`nvfp4_scale`, :func:`fp4_grid` of ``x / scale``,
    times the scale), bit for bit, in about half its time (1.9 against 3.5 ms for a 512 x 1024 input, one
    thread): each step runs in place on one buffer, in cache-sized slices of rows. A block's largest magnitude
    is a max-pool of ``|x|`` (a reduction over 16 values per output cost as much as a dozen elementwise
    passes); ``|x| / scale`` (equal to ``|x / scale|``) is rounded by adding and subtracting ``step * 2**23``,
    whose float32 unit in the last place is the E2M1 step (its exponent is ``|x / scale|``'s, clamped: three
    integer passes); the sum rounds half to even like ``round(|x / scale| / step) * step``, since ``2**23`` is
    even; the sign is copied back from ``x``.
    """
    channels = x.shape[-1]
    if channels % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 scales blocks of {NVFP4_BLOCK} input channels, which do not divide {channels}")
    rows = x.reshape(-1, channels)
    out = torch.empty(rows.shape, dtype=torch.float32, device=x.device)
    global_scale = global_scale.to(device=x.device, dtype=torch.float32)
    if not rows.numel():  # no tokens: nothing to scale (the max-pool refuses an empty input)
        return out.reshape(x.shape)
    for part in row_slices(rows, INPUT_SLICE_ELEMENTS):
        _fake_quantize_nvfp4_rows(rows[part], out[part], global_scale)
    return out.reshape(x.shape)


#: the float32 exponent field, the field of 1.0, and what turns a clamped field (1, 2 or 4) into ``step * 2**23``
_EXPONENT_BITS = 0x7F800000
_ONE_BITS = 127 << 23
_STEP_TIMES_2_23 = 22 << 23  # step = 2**(e - 1); times 2**23: 2**(e + 22)


def _fake_quantize_nvfp4_rows(x: Tensor, out: Tensor, global_scale: Tensor) -> None:
    rows, channels = x.shape
    torch.abs(x, out=out)
    amax = torch.nn.functional.max_pool1d(out, NVFP4_BLOCK)  # (rows, blocks); NaN propagates (refused below)
    scale = nvfp4_scale(amax, global_scale).unsqueeze(-1)
    magnitude = out.view(rows, channels // NVFP4_BLOCK, NVFP4_BLOCK).div_(scale).clamp_(max=FP4_MAX)
    # the E2M1 binade's exponent: 0 below 2, 1 in [2, 4), 2 in [4, 6] (magnitudes below 1 share the step of 1)
    magic = torch.bitwise_and(magnitude.view(torch.int32), _EXPONENT_BITS).clamp_(min=_ONE_BITS)
    magic = magic.add_(_STEP_TIMES_2_23).view(torch.float32)
    magnitude.add_(magic).sub_(magic).copysign_(x.reshape(magnitude.shape)).mul_(scale)
