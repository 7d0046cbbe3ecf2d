"""DeepSeek-V3 (MLA attention, shared + routed experts, grouped top-k routing): one decoder layer
at a time, routed experts as per-expert Linear layers, every expert calibrated on every token
(see :mod:`layerwise.model_zoo.moe`). The shared experts and the first dense layers are plain
Linear MLPs and are calibrated as usual; the router's correction bias is left alone."""

from __future__ import annotations

from layerwise import ModelPatch, hookimpl

from . import _inputs, moe


def sample_inputs(config, modality: str = "text", batch: int = 2, seq_len: int = 16):
    _inputs.check_modality("DeepSeek-V3", modality, (_inputs.TEXT,))
    return _inputs.text_inputs(config.vocab_size, batch, seq_len, avoid=_inputs.special_ids(config))


DEEPSEEK_V3 = ModelPatch(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    architectures=("DeepseekV3ForCausalLM", "DeepseekV3Model"),
    sequential_targets=("DeepseekV3DecoderLayer",),
    ignore=moe.MOE_IGNORE,
    apply=moe.unfuse_experts,
    calibration_context=moe.calibrate_all_experts,
    sample_inputs=sample_inputs,
    verified_transformers=("5.23.0",),
)


@hookimpl
def layerwise_register_model_patches(register):
    register(DEEPSEEK_V3)
