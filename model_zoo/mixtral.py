"""Mixtral: one decoder layer at a time, experts as per-expert Linear layers, every expert
calibrated on every token (see :mod:`layerwise.model_zoo.moe`)."""

from __future__ import annotations

from layerwise import ModelPatch, hookimpl

from . import _inputs, moe


def sample_inputs(config, modality: str = "text", batch: int = 2, seq_len: int = 16):
    _inputs.check_modality("Mixtral", modality, (_inputs.TEXT,))
    return _inputs.text_inputs(config.vocab_size, batch, seq_len, avoid=_inputs.special_ids(config))


MIXTRAL = ModelPatch(
    name="mixtral",
    model_types=("mixtral",),
    architectures=("MixtralForCausalLM", "MixtralModel"),
    sequential_targets=("MixtralDecoderLayer",),
    ignore=moe.MOE_IGNORE,
    apply=moe.unfuse_experts,
    calibration_context=moe.calibrate_all_experts,
    sample_inputs=sample_inputs,
    verified_transformers=("5.23.0",),
)


@hookimpl
def layerwise_register_model_patches(register):
    register(MIXTRAL)
