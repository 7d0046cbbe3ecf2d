"""The FP8 KV cache on the zoo's vision-language models calibrated with text: only the text decoder's attention
gets ``k_scale`` / ``v_scale`` (a vision encoder has no KV cache in vLLM; the patches name the decoder's attention
in ``attention_modules``), an ``ignore`` entry matching an attention layer keeps its scales out, and MLA
(DeepSeek-V3, whose cache is a latent) is refused before any work."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from zoo_tiny_models import ARCHS

import layerwise
from layerwise.algorithms.quantization.attention import quantized_attention
from layerwise.errors import RecipeError
from tests.conftest import build_tiny_llama


def _text_data(samples: int = 3) -> list[dict[str, torch.Tensor]]:
    """Text-only batches (token ids and mask) for a zoo model, seeded."""
    generator = torch.Generator().manual_seed(0)
    # ids 3..119: inside the tiny Llama vocab (128), clear of the special and image tokens (250 and up)
    ids = [torch.randint(3, 120, (1, 12), generator=generator) for _ in range(samples)]
    return [{"input_ids": i, "attention_mask": torch.ones_like(i)} for i in ids]


def _recipe(scheme=None, ignore=None):
    body = {"scheme": scheme, "kv_cache_scheme": "fp8"}
    if ignore:
        body["ignore"] = ignore
    return {"QuantizationModifier": body}


def _attention_with_scales(model) -> set[str]:
    return {name for name, module in model.named_modules() if "k_scale" in module._buffers}


def _saved_scale_layers(out) -> set[str]:
    tensors = load_file(str(out / "model.safetensors"))
    keys = {k.removesuffix(".k_scale") for k in tensors if k.endswith(".k_scale")}
    assert keys == {k.removesuffix(".v_scale") for k in tensors if k.endswith(".v_scale")}
    return keys


@pytest.mark.parametrize("scheme,ignore", [(None, None), ("W8A16", ["lm_head", "re:.*vision_tower.*"])],
                         ids=["kv-only", "w8a16-vision-ignored"])
def test_gemma3_text_calibration_scales_only_the_decoder_attention(tmp_path, scheme, ignore):
    model = ARCHS["gemma3"].build()
    out = tmp_path / "out"
    layerwise.compress(model, _recipe(scheme, ignore), dataset=_text_data(), output_dir=out,
                       show_progress=False)
    decoder = {f"model.language_model.layers.{i}.self_attn" for i in range(2)}
    assert set(quantized_attention(model)) == decoder == _attention_with_scales(model)
    vision = model.model.vision_tower.encoder.layers[0].self_attn
    assert "k_scale" not in vision._buffers and "v_scale" not in vision._buffers
    saved = _saved_scale_layers(out)
    # under the checkpoint's own names (language_model.model.layers.N.self_attn)
    assert len(saved) == 2 and all(k.endswith("self_attn") and "language_model" in k and "vision" not in k for k in saved)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["kv_cache_scheme"]["num_bits"] == 8


def test_mllama_text_calibration_needs_the_cross_attention_ignored_and_then_scales_self_attention(tmp_path):
    """Mllama's cross-attention has a KV cache in vLLM (the image's keys and values), so the patch names it; text
    never reaches it: the error names the layer and both fixes, and ignoring it calibrates the self-attention."""
    model = ARCHS["mllama"].build()
    with pytest.raises(RecipeError, match=r"'model\.language_model\.layers\.1\.cross_attn' saw no calibration "
                                          r"data.*image samples.*add it to ignore"):
        layerwise.compress(model, _recipe(), dataset=_text_data(), show_progress=False)

    model = ARCHS["mllama"].build()
    out = tmp_path / "out"
    layerwise.compress(model, _recipe(ignore=["lm_head", "re:.*cross_attn.*"]), dataset=_text_data(),
                       output_dir=out, show_progress=False)
    decoder = {"model.language_model.layers.0.self_attn", "model.language_model.layers.2.self_attn"}
    assert set(quantized_attention(model)) == decoder == _attention_with_scales(model)
    assert "k_scale" not in model.model.vision_model.transformer.layers[0].self_attn._buffers
    saved = _saved_scale_layers(out)
    assert len(saved) == 2 and all(k.endswith("self_attn") and "vision" not in k for k in saved)


@pytest.mark.filterwarnings("error::layerwise.common.matching.IgnoreWarning")
@pytest.mark.parametrize("scheme", [None, "W8A16"])
def test_an_ignore_entry_matching_an_attention_layer_keeps_its_kv_scales_out(scheme):
    """Not warned about as an entry matching only blocks: with a KV cache it keeps that layer's scales out."""
    model = build_tiny_llama()
    layerwise.compress(model, _recipe(scheme, ignore=["lm_head", "re:.*layers\\.0\\.self_attn"]),
                       dataset=_text_data(), show_progress=False)
    assert set(quantized_attention(model)) == {"model.layers.1.self_attn"}
    assert "k_scale" not in model.model.layers[0].self_attn._buffers

    with pytest.raises(RecipeError, match=r"every attention layer of LlamaForCausalLM .* is ignored.*narrow the "
                                          r"ignore entries or leave kv_cache_scheme out"):
        layerwise.compress(build_tiny_llama(), _recipe(ignore=["re:.*self_attn"]), dataset=_text_data(),
                           show_progress=False)


def test_deepseek_v3_mla_is_refused_naming_the_reason_and_the_fix_before_any_work():
    model = ARCHS["deepseek_v3"].build()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RecipeError, match=r"kv_cache_scheme: DeepseekV3ForCausalLM \(model patch 'deepseek_v3'\): "
                                          r"MLA attention caches one compressed latent.*leave kv_cache_scheme out"):
        layerwise.compress(model, _recipe("W8A16"), dataset=_text_data(), show_progress=False)
    # the patch unfused the experts as the model loaded; every weight it kept is untouched
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters() if n in before)


def test_whisper_scales_the_decoder_s_self_and_cross_attention_not_the_encoder_s(tmp_path):
    """vLLM caches Whisper's decoder self-attention and cross-attention (the encoder output's keys and values);
    the encoder's attention has no cache, so it gets no scales."""
    from layerwise.model_zoo.whisper import sample_inputs

    model = ARCHS["whisper"].build()
    audio = sample_inputs(model.config)
    data = [{name: value[i:i + 1] for name, value in audio.items()} for i in range(2)]
    out = tmp_path / "out"
    layerwise.compress(model, _recipe(), dataset=data, output_dir=out, show_progress=False)
    decoder = {f"model.decoder.layers.{i}.{kind}" for i in range(2) for kind in ("self_attn", "encoder_attn")}
    assert set(quantized_attention(model)) == decoder == _attention_with_scales(model)
    assert not any("encoder.layers" in name for name in _saved_scale_layers(out))
    assert len(_saved_scale_layers(out)) == 4
