"""The vLLM table's FP8 KV cache rows: which GPU generations serve per-tensor and per-head scales."""

from __future__ import annotations

from layerwise.algorithms.quantization.kv_cache import FP8_KV
from layerwise.planning.serving import vllm_kv_cache_support

HEAD = FP8_KV.replace(strategy="attn_head")


def test_fp8_kv_cache_by_gpu_generation():
    assert vllm_kv_cache_support(FP8_KV, (7, 5)).status == "none"  # Turing
    assert vllm_kv_cache_support(FP8_KV, (8, 0)).status == "native"  # A100: FlashInfer / Triton
    assert vllm_kv_cache_support(FP8_KV, (9, 0)).kernel.startswith("FlashAttention 3")
    assert vllm_kv_cache_support(FP8_KV, (8, 9), queries=True).status == "fallback"  # q_scale unused off Hopper
    assert vllm_kv_cache_support(HEAD, (9, 0)).status == "native"
    assert vllm_kv_cache_support(HEAD, (10, 0)).status == "none" and "strategy tensor" in vllm_kv_cache_support(
        HEAD, (10, 0)).kernel

