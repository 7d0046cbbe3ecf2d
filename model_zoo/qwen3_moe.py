"""Qwen3-MoE: one decoder layer at a time, experts as per-expert Linear layers, every expert
calibrated on every token (see :mod:`layerwise.model_zoo.moe`)."""

from __future__ import annotations

from layerwise import ModelPatch, hookimpl

from . import _inputs, moe


def sample_inputs(config, modality: str = "text", batch: int = 2, seq_len: int = 16):
    _inputs.check_modality("Qwen3-MoE", modality, (_inputs.TEXT,))
    return _inputs.text_inputs(config.vocab_size, batch, seq_len, avoid=_inputs.special_ids(config))


QWEN3_MOE = ModelPatch(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    architectures=("Qwen3MoeForCausalLM", "Qwen3MoeModel"),
    sequential_targets=("Qwen3MoeDecoderLayer",),
    ignore=moe.MOE_IGNORE,
    apply=moe.unfuse_experts,
    calibration_context=moe.calibrate_all_experts,
    sample_inputs=sample_inputs,
    verified_transformers=("5.23.0",),
)


@hookimpl
def layerwise_register_model_patches(register):
    register(QWEN3_MOE)
