"""A tiny Llama whose attention projections are named ``wq/wk/wv`` (as some original checkpoints name them),
an architecture no built-in patch knows, and a plugin whose patch declares them fused: what the tests of
``ModelPatch.fused_projections`` (in memory and model-free) share."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaAttention

from layerwise import ModelPatch, hookimpl

#: the checkpoint's ``model_type``: no registered patch and no transformers class knows it
MODEL_TYPE = "wq-llama"
RENAMED = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv"}
WQ_PATCH = ModelPatch(name="wq-llama", model_types=(MODEL_TYPE,), architectures=("WqLlamaForCausalLM",),
                      fused_projections=(("wq", "wk", "wv"),))


class WqAttention(LlamaAttention):
    """Llama attention whose q/k/v modules are registered as ``wq/wk/wv``; the forward reads them by the old names."""

    q_proj = property(lambda self: self.wq)
    k_proj = property(lambda self: self.wk)
    v_proj = property(lambda self: self.wv)


class WqLlamaForCausalLM(LlamaForCausalLM):
    """:class:`LlamaForCausalLM` with every attention's projections renamed (their order kept)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        for layer in self.model.layers:
            attention = layer.self_attn
            attention._modules = {RENAMED.get(name, name): module for name, module in attention._modules.items()}
            attention.__class__ = WqAttention


def build_wq_llama(seed: int = 0, **overrides) -> WqLlamaForCausalLM:
    """Seeded, bfloat16 (as checkpoints are), random weights; q, k and v scaled apart so that their own NVFP4
    global scales differ."""
    from tests.conftest import tiny_llama_config

    torch.manual_seed(seed)
    model = WqLlamaForCausalLM(tiny_llama_config(**overrides)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            for factor, name in enumerate(("wq", "wk", "wv"), start=1):
                getattr(layer.self_attn, name).weight.mul_(factor)
    return model.to(torch.bfloat16)


def save_wq_llama(folder: Path, **overrides) -> Path:
    """:func:`build_wq_llama` saved as a checkpoint of :data:`MODEL_TYPE` (``architectures``:
    ``WqLlamaForCausalLM``), sharded in two or more files."""
    build_wq_llama(**overrides).save_pretrained(folder, max_shard_size="100KB")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": MODEL_TYPE}))
    return folder


class WqPlugin:
    """Registers :data:`WQ_PATCH`, as a third-party plugin would."""

    @hookimpl
    def layerwise_register_model_patches(self, register) -> None:
        register(WQ_PATCH)
