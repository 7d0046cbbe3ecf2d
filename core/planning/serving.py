"""Will vLLM run a scheme on a GPU generation? A small table of its kernels' limits.

Source: vLLM's compressed-tensors schemes and linear kernels (``get_min_capability`` of
``CompressedTensorsWNA16`` / ``W8A8Fp8`` / ``W8A16Fp8`` / ``W8A8Int8`` / ``W4A4Fp4`` / ``W4A16Fp4`` /
``W4A4Mxfp4`` / ``W8A8Mxfp8`` / ``W4A8Fp8``, the scheme choice in ``_get_scheme_from_parts``: NVFP4 on
Blackwell's FP4 tensor cores where ``cutlass_fp4_supported``, else FP4 Marlin with 16-bit inputs; W4A8-FP8
only on compute capability 9.0 exactly and groups of 128; Marlin's ``MARLIN_SUPPORTED_GROUP_SIZES``,
Machete's SM90-only rule, ``cutlass_scaled_mm_supports_fp8`` / ``supports_block_fp8``) and its quantization
hardware table, main branch as read on :data:`TABLE_DATE`. vLLM moves fast: the verdict is the table's,
said as such.

Each rule gives one of :data:`STATUSES`: ``native`` (a kernel made for the scheme), ``fallback``
(it runs, slower: weight-only emulation, Triton or Exllama kernels), ``none`` (vLLM refuses it).
"""

from __future__ import annotations

from dataclasses import dataclass

from layerwise.algorithms.quantization.args import QuantizationArgs

TABLE_DATE = "2026-11-27"
STATUSES = ("native", "fallback", "none")
#: group sizes Marlin (and so most weight-only int kernels) takes; -1 is per channel
MARLIN_GROUP_SIZES = (32, 64, 128)
#: Machete (Hopper's weight-only int kernel): per channel, or these group sizes
MACHETE_GROUP_SIZES = (64, 128)

#: the GEMM vLLM runs a low-bit float format in where the GPU computes in it (Blackwell, 10.0+)
FP4_NATIVE = {"nvfp4": "CUTLASS / FlashInfer FP4 GEMM (Blackwell FP4 tensor cores)",
              "mxfp4": "MX block-scaled FP4 GEMM (Blackwell)"}


@dataclass(frozen=True)
class Serving:
    """Whether vLLM serves one scheme on one compute capability."""

    status: str
    kernel: str

    @property
    def serves(self) -> bool:
        return self.status != "none"


def expert_group(name: str) -> str | None:
    """The experts module a layer of a mixture of experts belongs to, as vLLM sees one (``...experts.<e>.<projection>``:
    ``model.layers.3.mlp.experts``; vLLM runs it in its fused MoE kernels), ``None`` for a dense layer. String
    operations, no regex: a plan asks it of each of DeepSeek-V3's 45,032 layers."""
    head, found, tail = ("." + name).rpartition(".experts.")
    expert, dot, _ = tail.partition(".")
    return (head + ".experts")[1:] if found and dot and expert.isdigit() else None


def vllm_support(weights: QuantizationArgs, inputs: QuantizationArgs | None,
                 capability: tuple[int, int], expert: bool = False) -> Serving:
    """The table's answer for a layer quantized with ``weights`` (and ``inputs``) on ``capability``;
    ``expert``: a layer of a mixture of experts, which vLLM runs in its fused MoE kernels (fewer layouts:
    ``CompressedTensorsMoEMethod.get_moe_method``)."""
    cc = capability[0] * 10 + capability[1]
    if expert and weights.type == "int" and inputs is None:
        if not weights.symmetric:
            return Serving("none", "asymmetric int experts: vLLM's fused MoE kernels (Marlin / Triton WNA16) take "
                                   "symmetric weights only; quantize the experts symmetric (W4A16) or ignore them")
        if weights.num_bits not in (4, 8):
            return Serving("none", f"int{weights.num_bits} experts: vLLM's fused MoE kernels take 4 or 8 bits")
        return _int_experts(weights, cc)
    if weights.float_format in FP4_NATIVE:
        return _fp4(weights.float_format, inputs, cc)
    if weights.float_format == "mxfp8":
        return _mxfp8(inputs, cc)
    if weights.type == "float":
        return _fp8(weights, inputs, cc)
    if inputs is not None and inputs.type == "float":
        return _int4_fp8(weights, inputs, cc)
    if inputs is not None:
        return _int8_w8a8(weights, cc)
    return _weight_only_int(weights, cc)


def _int_experts(weights: QuantizationArgs, cc: int) -> Serving:
    """Symmetric int4 / int8 experts: Marlin's fused MoE where it takes the groups, else Triton's WNA16 MoE."""
    group = weights.group_size if weights.strategy == "group" else -1
    if cc >= 80 and (group == -1 or group in MARLIN_GROUP_SIZES):
        return Serving("native", "Marlin MoE (fused experts)")
    if weights.strategy == "group" and weights.actorder not in ("group", "dynamic"):
        return Serving("fallback", "Triton WNA16 MoE (fused experts"
                                   + (f"; group size {group} is not Marlin's)" if cc >= 80 else "; Marlin from 8.0)"))
    return Serving("none", "vLLM's Triton WNA16 MoE takes per-group weights without group activation order, and "
                           "Marlin MoE (8.0+) groups of 32/64/128 or per channel")


def _fp4(fmt: str, inputs: QuantizationArgs | None, cc: int) -> Serving:
    """NVFP4 / MXFP4: weight-only through FP4 Marlin from 8.0; FP4 inputs on Blackwell's FP4 tensor cores."""
    marlin = f"{fmt.upper()} Marlin, weight-only"
    if cc < 80:
        return Serving("none", f"{fmt.upper()} needs compute capability 8.0 or higher ({marlin})")
    if inputs is None:
        return Serving("native", f"{marlin} (inputs stay 16-bit)")
    if cc >= 100:
        return Serving("native", FP4_NATIVE[fmt])
    return Serving("fallback", f"{marlin}: no FP4 tensor cores below 10.0, the inputs stay 16-bit")


def _mxfp8(inputs: QuantizationArgs | None, cc: int) -> Serving:
    if cc < 75:
        return Serving("none", "MXFP8 needs compute capability 7.5 or higher")
    if cc >= 100:
        return Serving("native", "MX block-scaled FP8 GEMM (Blackwell)")
    return Serving("fallback", "MXFP8 emulated or weight-only below 10.0 (no MX tensor cores)"
                               + (": the inputs stay 16-bit" if inputs is not None else ""))


def _int4_fp8(weights: QuantizationArgs, inputs: QuantizationArgs, cc: int) -> Serving:
    """Integer weights with float8 inputs: vLLM's one kernel is W4A8-FP8 (CUTLASS, Hopper only)."""
    shape = (weights.num_bits == 4 and weights.symmetric and weights.strategy == "group" and inputs.num_bits == 8
             and inputs.symmetric and inputs.strategy == "token" and inputs.dynamic)
    if not shape:
        return Serving("none", f"int{weights.num_bits} weights with float8 inputs: vLLM's only kernel takes int4 "
                               "symmetric groups of 128 with float8 per-token dynamic inputs (W4AFP8)")
    if weights.group_size != 128:
        return Serving("none", f"group size {weights.group_size}: vLLM's W4A8-FP8 kernel takes groups of 128 only")
    if cc == 90:
        return Serving("native", "CUTLASS W4A8 (int4 x FP8, Hopper)")
    return Serving("none", "vLLM's W4A8-FP8 kernel runs on compute capability 9.0 (Hopper) only and no other "
                           "scheme takes int4 weights with float8 inputs: save W4A16 for this GPU")


def _weight_only_int(weights: QuantizationArgs, cc: int) -> Serving:
    if weights.strategy not in ("channel", "group"):
        return Serving("none", f"int{weights.num_bits} weight-only per {weights.strategy}: vLLM's WNA16 scheme takes "
                               f"channel or group strategies only")
    if weights.num_bits not in (4, 8):
        return Serving("none", f"int{weights.num_bits}: vLLM's WNA16 kernels take 4 or 8 bits")
    group = weights.group_size if weights.strategy == "group" else -1
    marlin_group = group == -1 or group in MARLIN_GROUP_SIZES
    marlin_type = weights.symmetric or weights.num_bits == 4  # asymmetric: Marlin's uint4 (AWQ style) only
    if cc < 60:
        return Serving("none", "compute capability below 6.0: no weight-only int kernel")
    if cc == 90 and weights.symmetric and (group == -1 or group in MACHETE_GROUP_SIZES):
        return Serving("native", "Machete (Hopper)")
    if cc >= 75 and marlin_group and marlin_type:
        return Serving("native", "Marlin")
    if weights.symmetric:
        why = f"group size {group} is not one Marlin takes ({', '.join(map(str, MARLIN_GROUP_SIZES))}, channel)" \
            if not marlin_group else "no Marlin below compute capability 7.5"
        return Serving("fallback", f"Exllama/Triton ({why})")
    why = "asymmetric 8-bit" if not marlin_type else f"asymmetric, group size {group}"
    return Serving("none", f"{why}: no vLLM kernel (Marlin takes asymmetric int4 with groups "
                           f"{', '.join(map(str, MARLIN_GROUP_SIZES))} or per channel)")


def _fp8(weights: QuantizationArgs, inputs: QuantizationArgs | None, cc: int) -> Serving:
    if cc < 75:
        return Serving("none", "FP8 needs compute capability 7.5 or higher (FP8 Marlin, weight-only)")
    if weights.strategy == "block":
        if cc >= 90:
            return Serving("native", "CUTLASS/DeepGEMM block FP8")
        return Serving("fallback", "Triton/Marlin block FP8 (no CUTLASS block FP8 below Hopper)")
    if inputs is None:
        return Serving("native" if cc >= 89 else "fallback", "FP8 weight-only (Marlin FP8)")
    if cc >= 89:
        return Serving("native", "CUTLASS FP8 scaled matmul")
    return Serving("fallback", "weight-only FP8 Marlin (no FP8 tensor cores below 8.9: inputs stay 16-bit)")


def _int8_w8a8(weights: QuantizationArgs, cc: int) -> Serving:
    if weights.num_bits != 8:
        return Serving("none", f"int{weights.num_bits} weights with quantized inputs: no vLLM kernel")
    if cc < 75:
        return Serving("none", "int8 W8A8 needs compute capability 7.5 or higher")
    if cc >= 100:
        return Serving("none", "int8 W8A8 is not supported on compute capability 10.0 and above (vLLM docs)")
    return Serving("native", "CUTLASS int8 scaled matmul")


def vllm_kv_cache_support(kv_args: QuantizationArgs, capability: tuple[int, int], queries: bool = False) -> Serving:
    """The table's answer for an FP8 KV cache (``--kv-cache-dtype fp8`` with the checkpoint's ``k_scale`` /
    ``v_scale``; ``queries``: FP8 attention's ``q_scale`` too) on ``capability``. vLLM's docs as read on
    :data:`TABLE_DATE`: FlashInfer and the Triton attention backend store an E4M3 cache from 8.0 (Ampere, Ada,
    Blackwell's consumer parts); FlashAttention 3 (Hopper, 9.0) computes attention in FP8, queries quantized
    too; per-head scales only with the FlashAttention backend."""
    cc = capability[0] * 10 + capability[1]
    if cc < 80:
        return Serving("none", "an FP8 KV cache needs compute capability 8.0 or higher (FlashInfer / Triton attention)")
    if kv_args.strategy == "attn_head":
        if cc == 90:
            return Serving("native", "FlashAttention 3, per-head FP8 scales")
        return Serving("none", "per-head KV scales are read by vLLM's FlashAttention 3 backend only (Hopper, 9.0); "
                               "use strategy tensor")
    if cc == 90:
        return Serving("native", "FlashAttention 3 (attention in FP8" + (", queries scaled by q_scale)" if queries
                                                                          else ")"))
    if queries:
        return Serving("fallback", "FP8 KV cache (FlashInfer / Triton); q_scale unused: attention runs in 16-bit")
    return Serving("native", "FP8 KV cache (FlashInfer / Triton attention)")
