"""Dynamic per-token input scales on a reloaded model are per row, whatever the rank of the layer's input
(compressed-tensors' are per leading pair of dimensions: per sequence on DeepSeek-V3's 4-D MLA latent)."""

from __future__ import annotations

import pytest
import torch

import layerwise
from layerwise.plugin import registry
from tests.conftest import build_tiny_llama


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _tiny_deepseek_v3(dtype):
    """The zoo's tiny DeepSeek-V3 in ``dtype`` as a loader builds it: the rotary frequencies stay float32
    (``.to()`` would round them, ``from_pretrained(dtype=...)`` does not)."""
    model = registry("model_patches").get("deepseek_v3").tiny_models[0]()
    frequencies = {name: buffer for name, buffer in model.named_buffers() if "inv_freq" in name}
    model = model.to(dtype)
    for name, buffer in frequencies.items():
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, buffer)
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_deepseek_v3_fp8_dynamic_reloads_to_the_in_memory_logits_exactly(dtype, tmp_path):
    """kv_b_proj reads its latent as (batch, 1, seq, rank): it drifted 0.01-0.1 on the logits when reloaded."""
    model = _tiny_deepseek_v3(dtype)
    model = layerwise.compress(model, "FP8_DYNAMIC", output_dir=tmp_path / "out", show_progress=False).eval()
    reloaded = layerwise.load_compressed(tmp_path / "out", dtype=dtype).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    expected, got = _logits(model, ids), _logits(reloaded, ids)
    assert torch.equal(got, expected), f"max abs diff {(got - expected).abs().max().item()}"


@pytest.mark.parametrize("rows", [(24,), (2, 1, 12), (2, 12)], ids=["2-D", "4-D", "3-D"])
def test_a_reloaded_layer_quantizes_each_row_of_an_input_of_any_rank_as_the_compressed_one(rows, tmp_path):
    model = layerwise.compress(build_tiny_llama(), "FP8_DYNAMIC", output_dir=tmp_path / "out",
                               show_progress=False).eval()
    reloaded = layerwise.load_compressed(tmp_path / "out").eval()
    _logits(reloaded, torch.zeros(1, 2, dtype=torch.long))  # compressed-tensors finishes loading on a first forward
    name = "model.layers.0.mlp.up_proj"
    x = torch.randn(*rows, model.get_submodule(name).in_features, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(reloaded.get_submodule(name)(x), model.get_submodule(name)(x))
