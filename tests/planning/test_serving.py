"""The vLLM kernel table: each preset's verdict per GPU generation (Turing, Ampere, Ada, Hopper, Blackwell)."""

from __future__ import annotations

import pytest

from layerwise.algorithms.quantization.presets import PRESETS
from layerwise.planning.plan import describe_scheme
from layerwise.planning.serving import vllm_support

GENERATIONS = {"T4": (7, 5), "A100": (8, 0), "L40S": (8, 9), "H100": (9, 0), "B200": (10, 0), "RTX5090": (12, 0)}

# n: native, f: fallback (runs, slower), -: none; one letter per GPU above, in order
EXPECTED = {
    "W4A16": "nnnnnn",        # Marlin (Machete on Hopper)
    "W8A16": "nnnnnn",
    "W8A8": "nnnn--",         # CUTLASS int8: none on 10.0 and above
    "FP8_DYNAMIC": "ffnnnn",  # FP8 tensor cores from 8.9; FP8 Marlin (weight-only) before
    "FP8_BLOCK": "fffnnn",
    "NVFP4A16": "-nnnnn",     # FP4 Marlin from 8.0
    "NVFP4": "-fffnn",        # FP4 tensor cores on Blackwell, FP4 Marlin with 16-bit inputs before
    "MXFP4A16": "-nnnnn",
    "MXFP4": "-fffnn",
    "MXFP8A16": "ffffnn",
    "MXFP8": "ffffnn",
    "W4AFP8": "---n--",       # CUTLASS W4A8-FP8: Hopper only
}
LETTER = {"native": "n", "fallback": "f", "none": "-"}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_each_preset_s_kernel_by_gpu_generation(preset):
    scheme = PRESETS[preset]
    got = "".join(LETTER[vllm_support(scheme.weights, scheme.input_activations, cc).status]
                  for cc in GENERATIONS.values())
    assert got == EXPECTED[preset], dict(zip(GENERATIONS, got))


def test_the_low_bit_floats_are_named_by_their_format_and_say_why_a_gpu_falls_back():
    nvfp4, w4afp8 = PRESETS["NVFP4"], PRESETS["W4AFP8"]
    assert describe_scheme(nvfp4.weights, nvfp4.input_activations) == (
        "weights nvfp4 (blocks of 16), inputs nvfp4 (blocks of 16) dynamic")
    assert "inputs stay 16-bit" in vllm_support(nvfp4.weights, nvfp4.input_activations, (9, 0)).kernel
    assert "W4A16" in vllm_support(w4afp8.weights, w4afp8.input_activations, (10, 0)).kernel
    other_group = w4afp8.weights.replace(group_size=64)
    assert "groups of 128" in vllm_support(other_group, w4afp8.input_activations, (9, 0)).kernel


def test_int_experts_follow_vllm_s_fused_moe_kernels():
    w4a16, asym = PRESETS["W4A16"].weights, PRESETS["W4A16_ASYM"].weights
    assert vllm_support(w4a16, None, (9, 0), expert=True).kernel == "Marlin MoE (fused experts)"
    assert vllm_support(w4a16, None, (9, 0)).kernel == "Machete (Hopper)"  # the same layer, dense
    assert vllm_support(asym, None, (9, 0), expert=True).status == "none"
    assert vllm_support(asym, None, (9, 0)).status == "native"  # Marlin's uint4, dense only
    assert vllm_support(w4a16.replace(group_size=16), None, (9, 0), expert=True).status == "fallback"  # Triton
    assert vllm_support(w4a16.replace(num_bits=3), None, (9, 0), expert=True).status == "none"
