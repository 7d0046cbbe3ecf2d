"""kv_cache_scheme through a compression run: scales calibrated on the post-RoPE keys through the sequential
pipeline, the in-memory model computing with the FP8 cache, the saved checkpoint (config field and tensors as
compressed-tensors writes them) and its reload, recipes, the CLI flag, and the errors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import layerwise
from layerwise.algorithms.quantization.attention import (
    attention_state,
    find_attention_modules,
    quantized_attention,
)
from layerwise.errors import RecipeError
from layerwise.host.recipe import parse_recipe, recipe_to_yaml
from layerwise.testing import token_batches
from tests.conftest import build_tiny_llama

DATA = token_batches(8, 16, vocab=128)
IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))


def kv_recipe(kv, scheme=None, modifier="QuantizationModifier"):
    return {modifier: {"scheme": scheme, "kv_cache_scheme": kv}}


@pytest.fixture(scope="module", params=[("fp8", None), ("fp8_head", "W8A16")], ids=["tensor-kv-only", "head-w8a16"])
def saved(request, tmp_path_factory):
    kv, scheme = request.param
    out = tmp_path_factory.mktemp("kv") / "out"
    model = build_tiny_llama()
    layerwise.compress(model, kv_recipe(kv, scheme), dataset=DATA, output_dir=out, show_progress=False)
    with torch.no_grad():
        logits = model(IDS).logits
    return kv, scheme, model, logits, out


@torch.no_grad()
def test_layer_zero_scales_are_the_largest_post_rope_key_and_value_over_448():
    """Layer 0 reads the embeddings, which no quantization touches: its scales are the calibration data's
    largest keys and values (after RoPE) of the original model, over 448, per head."""
    original, model = build_tiny_llama(), build_tiny_llama()
    layerwise.compress(model, kv_recipe("fp8_head"), dataset=DATA, show_progress=False)
    seen = {"key": [], "value": []}
    from layerwise.algorithms.quantization.attention import attach

    attach(original.model.layers[0].self_attn).observe(
        lambda kind, s: seen[kind].append(s.abs().amax(dim=(0, 2, 3))) if kind in seen else None)
    for batch in DATA:
        original(**batch)
    attention = model.model.layers[0].self_attn
    for kind, buffer in (("key", "k_scale"), ("value", "v_scale")):
        expected = torch.stack(seen[kind]).amax(0).reshape(2, 1, 1) / 448
        assert torch.equal(attention._buffers[buffer], expected)


def test_the_in_memory_model_computes_with_the_fp8_cache(saved):
    _, scheme, model, logits, _ = saved
    assert set(quantized_attention(model)) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    reference = build_tiny_llama()
    if scheme is None:  # the KV cache only: every other weight is the original's
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    with torch.no_grad():
        assert not torch.equal(logits, reference(IDS).logits)
        states = [attention_state(m) for m in quantized_attention(model).values()]
        args = [state.kv_args for state in states]
        for state in states:
            state.kv_args = None  # the cache unquantized again
        unquantized = model(IDS).logits
        for state, kv_args in zip(states, args):
            state.kv_args = kv_args
    if scheme is None:
        assert torch.equal(unquantized, reference(IDS).logits)
    assert 0 < (unquantized - logits).abs().max() < 0.05


def test_config_field_is_compressed_tensors_own_serialization(saved):
    from compressed_tensors.quantization import QuantizationArgs as CTArgs
    from compressed_tensors.quantization import QuantizationConfig

    kv, scheme, _, _, out = saved
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    strategy = "attn_head" if kv == "fp8_head" else "tensor"
    expected = CTArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=False,
                      observer="minmax").model_dump(mode="json")
    assert quant["kv_cache_scheme"] == expected
    assert QuantizationConfig.model_validate(quant).model_dump(mode="json")["kv_cache_scheme"] == expected
    assert quant["format"] == ("dense" if scheme is None else "pack-quantized")
    assert (quant["config_groups"] == {}) == (scheme is None)


def test_scale_tensors_have_the_names_shapes_and_dtype_compressed_tensors_initializes(saved):
    from compressed_tensors.quantization import QuantizationArgs as CTArgs
    from compressed_tensors.quantization.lifecycle.initialize import initialize_qparams

    kv, _, model, _, out = saved
    tensors = load_file(out / "model.safetensors")
    strategy = "attn_head" if kv == "fp8_head" else "tensor"
    probe = torch.nn.Linear(1, 1)
    initialize_qparams(probe, "k", CTArgs(num_bits=8, type="float", strategy=strategy, dynamic=False),
                       observed_shape=(model.config.num_key_value_heads, None, 16), observed_dtype=torch.float32,
                       force_zero_point=False)
    scales = {k: v for k, v in tensors.items() if k.endswith(("k_scale", "v_scale"))}
    assert sorted(scales) == [f"model.layers.{i}.self_attn.{s}" for i in (0, 1) for s in ("k_scale", "v_scale")]
    assert all(v.shape == probe.k_scale.shape and v.dtype == probe.k_scale.dtype for v in scales.values())
    assert not any(k.endswith("zero_point") and "self_attn." in k and "proj" not in k for k in tensors)


def test_load_compressed_reproduces_the_in_memory_outputs_without_load_warnings(saved):
    _, _, _, logits, out = saved
    reloaded, info = layerwise.load_compressed(out, output_loading_info=True)
    assert not info["unexpected_keys"] and not info["missing_keys"]
    assert set(quantized_attention(reloaded)) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    with torch.no_grad():
        assert (reloaded(IDS).logits - logits).abs().max() == 0


def test_gptq_calibrates_the_kv_cache_in_the_same_run(tmp_path):
    model = build_tiny_llama()
    layerwise.compress(model, {"GPTQModifier": {"scheme": "W8A16", "kv_cache_scheme": {"num_bits": 8, "type": "float",
                                                                                      "strategy": "tensor"}}},
                       dataset=token_batches(16, 16, vocab=128), show_progress=False)
    assert set(quantized_attention(model)) == set(find_attention_modules(model))
    assert model.model.layers[1].self_attn.k_scale.shape == (1,)


def test_recipes_round_trip_and_the_cli_flag_appends_a_kv_modifier():
    from layerwise.cli.app import with_kv_cache

    (modifier,) = parse_recipe("QuantizationModifier:\n  scheme: W8A16\n  kv_cache_scheme: {num_bits: 8, type: float,"
                               " strategy: attn_head, dynamic: false, symmetric: true}\n")
    assert modifier.requires_data and parse_recipe(recipe_to_yaml([modifier]))[0].kv_cache_scheme == \
        modifier.kv_cache_scheme
    weights, kv = parse_recipe(with_kv_cache("GPTQ_W4A16", "fp8_head"))
    assert type(weights).__name__ == "GPTQModifier" and kv.scheme is None and kv.kv_cache_scheme == "fp8_head"
    assert with_kv_cache("W4A16", None) == "W4A16"


def test_a_kv_cache_scheme_without_a_scheme_quantizes_only_the_kv_cache_as_llm_compressor_does():
    """llm-compressor's KV-cache-only recipe writes no scheme; the default W4A16 quantized every weight too."""
    (kv_only,) = parse_recipe("QuantizationModifier:\n  kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor,"
                              " dynamic: false, symmetric: true, observer: static_minmax}\n")
    assert kv_only.scheme is None and kv_only.args is None and kv_only.requires_data
    assert parse_recipe(recipe_to_yaml([kv_only]))[0].scheme is None  # saved as scheme: null
    from layerwise.plugins.modifiers.quantization import QuantizationModifier

    assert QuantizationModifier(kv_cache_scheme="fp8").args is None
    assert QuantizationModifier(attention_scheme="fp8").scheme is None
    # a scheme or a weight field written keeps the weights quantized; so does any other modifier
    (written,) = parse_recipe({"QuantizationModifier": {"scheme": "W4A16", "kv_cache_scheme": "fp8"}})
    assert written.args is not None and written.args.num_bits == 4
    assert parse_recipe(recipe_to_yaml([written]))[0].args.num_bits == 4
    assert QuantizationModifier(num_bits=8, kv_cache_scheme="fp8").args.num_bits == 8
    assert QuantizationModifier().scheme == "W4A16" and type(QuantizationModifier().scheme) is str
    (gptq,) = parse_recipe(kv_recipe("fp8", "W4A16", "GPTQModifier"))
    assert gptq.args is not None


def test_a_compressed_tensors_args_object_as_kv_cache_scheme_saves_as_its_mapping():
    """recipe.yaml is written before the run: a pydantic object there was a raw yaml RepresenterError."""
    ct = pytest.importorskip("compressed_tensors.quantization")
    from layerwise.plugins.modifiers.quantization import QuantizationModifier

    kv = ct.QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    modifier = QuantizationModifier(scheme="FP8_DYNAMIC", kv_cache_scheme=kv)
    (again,) = parse_recipe(recipe_to_yaml([modifier]))
    assert again.kv_cache_scheme == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                                     "dynamic": False}
    assert again.kv_calibration.args == modifier.kv_calibration.args


def test_errors_come_before_any_work():
    with pytest.raises(RecipeError, match="GPTQModifier.scheme is null: give a scheme"):
        parse_recipe(kv_recipe("fp8", None, "GPTQModifier"))
    with pytest.raises(RecipeError, match="QuantizationModifier.scheme is null.*or a kv_cache_scheme"):
        parse_recipe({"QuantizationModifier": {"scheme": None}})
    with pytest.raises(RecipeError, match="AWQModifier.kv_cache_scheme: put the KV cache on a QuantizationModifier"):
        parse_recipe(kv_recipe("fp8", "W4A16_ASYM", "AWQModifier"))
    with pytest.raises(RecipeError, match="kv_cache_scheme: strategy 'token' is not a KV cache strategy"):
        parse_recipe(kv_recipe({"num_bits": 8, "type": "float", "strategy": "token"}))


def test_a_model_without_attention_layers_is_refused_naming_the_patch_field():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.proj = torch.nn.Embedding(128, 4), torch.nn.Linear(4, 4)

        def forward(self, input_ids, **kwargs):
            return self.proj(self.embed(input_ids))

    model = Tiny()
    before = model.proj.weight.clone()
    with pytest.raises(RecipeError, match=r"kv_cache_scheme: Tiny has no attention layer.*ModelPatch.attention_modules"):
        layerwise.compress(model, kv_recipe("fp8", "W8A16"), dataset=DATA, show_progress=False)
    assert torch.equal(model.proj.weight, before)


ATTENTION_GROUPS = {
    "weights": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}},
    "attention": {"targets": ["LlamaAttention"], "input_activations": {
        "num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": False, "symmetric": True}},
}


def test_fp8_attention_from_llm_compressors_config_group_quantizes_queries_and_round_trips(tmp_path):
    """llm-compressor's FP8 attention recipe (a config group with input_activations targeting the attention
    class): q_scale beside k_scale / v_scale, per head, the config group and kv_cache_scheme compressed-tensors
    writes, and a reload to the same outputs."""
    from compressed_tensors.quantization import QuantizationConfig

    model, out = build_tiny_llama(), tmp_path / "out"
    recipe = {"QuantizationModifier": {"ignore": ["lm_head"], "config_groups": ATTENTION_GROUPS}}
    weights, attention = parse_recipe(recipe)
    assert weights.scheme is not None and attention.scheme is None and attention.attention_scheme["strategy"] == "attn_head"
    layerwise.compress(model, recipe, dataset=DATA, output_dir=out, show_progress=False)
    layer = model.model.layers[0].self_attn
    assert layer.q_scale.shape == (4, 1, 1) and layer.k_scale.shape == (2, 1, 1)
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    group = quant["config_groups"]["group_1"]
    assert group["targets"] == ["LlamaAttention"] and group["weights"] is None
    assert group["input_activations"] == quant["kv_cache_scheme"]
    assert QuantizationConfig.model_validate(quant).model_dump(mode="json")["config_groups"]["group_1"] == group
    assert load_file(out / "model.safetensors")["model.layers.1.self_attn.q_scale"].shape == (4, 1, 1)
    with torch.no_grad():
        logits = model(IDS).logits
        reloaded, info = layerwise.load_compressed(out, output_loading_info=True)
        assert not info["unexpected_keys"] and (reloaded(IDS).logits - logits).abs().max() == 0
    assert attention_state(reloaded.model.layers[0].self_attn).query_args is not None


@torch.no_grad()
def test_fp8_attention_query_scales_are_the_largest_post_rope_query_over_448():
    original, model = build_tiny_llama(), build_tiny_llama()
    layerwise.compress(model, {"QuantizationModifier": {"scheme": None, "attention_scheme": "fp8"}}, dataset=DATA,
                       show_progress=False)
    from layerwise.algorithms.quantization.attention import attach

    seen = []
    attach(original.model.layers[0].self_attn).observe(lambda kind, s: seen.append(s.abs().amax()) if kind == "query"
                                                      else None)
    for batch in DATA:
        original(**batch)
    assert torch.equal(model.model.layers[0].self_attn.q_scale, (torch.stack(seen).amax() / 448).reshape(1))


def test_fp8_attention_errors_name_the_fix():
    with pytest.raises(RecipeError, match="attention_scheme and kv_cache_scheme differ"):
        parse_recipe({"QuantizationModifier": {"scheme": None, "attention_scheme": "fp8", "kv_cache_scheme": "fp8_head"}})
    with pytest.raises(RecipeError, match="attention_scheme quantizes attention modules, not weights; give it with "
                                          "scheme: null"):
        parse_recipe({"QuantizationModifier": {"scheme": "W8A16", "attention_scheme": "fp8"}})
    with pytest.raises(RecipeError, match=r"targets \['MistralAttention'\] match no attention layer.*LlamaAttention"):
        layerwise.compress(build_tiny_llama(), {"QuantizationModifier": {
            "scheme": None, "attention_scheme": "fp8", "targets": ["MistralAttention"]}}, dataset=DATA,
            show_progress=False)


def test_the_cli_flag_saves_a_kv_cache_beside_the_recipe_and_refuses_the_demo(tiny_llama_dir, tmp_path, capsys):
    from layerwise.cli.app import main

    data = tmp_path / "calib.txt"
    data.write_text("\n".join(" ".join(f"w{(7 * line + i) % 120}" for i in range(24)) for line in range(8)))
    out = tmp_path / "out"
    assert main(["compress", "--model", str(tiny_llama_dir), "--recipe", "W8A16", "--kv-cache", "fp8_head",
                 "--dataset", str(data), "--num-samples", "4", "--max-seq-length", "16", "--output-dir", str(out),
                 "--quiet"]) == 0
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant["kv_cache_scheme"]["strategy"] == "attn_head" and quant["config_groups"]["group_0"]["weights"]
    assert "kv_cache_scheme: fp8_head" in (out / "recipe.yaml").read_text()
    assert main(["compress", "--kv-cache", "fp8", "--no-save"]) == 2
    assert "the embedded demo (MiniLM) is an encoder and has no KV cache" in capsys.readouterr().err


def test_a_resumed_run_puts_back_the_scales_calibrated_before_the_interruption():
    """The KV scales are plain data on the modifier, which a streamed run's checkpoint keeps: a fresh modifier
    given that state sets them on the attention layers without seeing data again."""
    from layerwise.model_io.resume import modifier_state, restore_modifier
    from layerwise.plugin import CompressionState

    model = build_tiny_llama()
    (modifier,) = parse_recipe(kv_recipe("fp8_head"))
    layerwise.compress(model, [modifier], dataset=DATA, show_progress=False)
    saved = modifier_state(modifier)
    assert set(saved["fields"]["_kv_scales"]) == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
    fresh_model = build_tiny_llama()
    (fresh,) = parse_recipe(kv_recipe("fp8_head"))
    fresh.on_initialize(CompressionState(model=fresh_model, modifiers=[fresh]))
    restore_modifier(fresh, saved)
    fresh.on_calibration_end(CompressionState(model=fresh_model, modifiers=[fresh]))
    for name in ("model.layers.0.self_attn", "model.layers.1.self_attn"):
        assert torch.equal(fresh_model.get_submodule(name).k_scale, model.get_submodule(name).k_scale)
    with torch.no_grad():
        assert torch.equal(fresh_model(IDS).logits, model(IDS).logits)


def test_a_streamed_run_writes_the_same_scales_as_an_in_memory_run(tiny_llama_dir, tmp_path):
    recipe = kv_recipe("fp8_head", "W8A16")
    for mode in ("memory", "stream"):
        layerwise.compress(str(tiny_llama_dir), recipe, dataset=DATA, output_dir=tmp_path / mode, show_progress=False,
                           options=layerwise.CompressOptions.of(weights=mode))
    memory, streamed = load_file(tmp_path / "memory" / "model.safetensors"), load_file(tmp_path / "stream" / "model.safetensors")
    assert set(memory) == set(streamed) and all(torch.equal(memory[k], streamed[k]) for k in memory)
    assert "model.layers.1.self_attn.v_scale" in streamed


def test_a_bfloat16_model_stores_bfloat16_scales_and_reloads_exactly(tiny_llama_dir, tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    layerwise.compress(model, kv_recipe("fp8"), dataset=DATA, output_dir=tmp_path / "out", show_progress=False)
    assert load_file(tmp_path / "out" / "model.safetensors")["model.layers.0.self_attn.k_scale"].dtype == torch.bfloat16
    with torch.no_grad():
        reloaded = layerwise.load_compressed(tmp_path / "out", dtype=torch.bfloat16)
        assert (reloaded(IDS).logits - model(IDS).logits).abs().max() == 0


@pytest.mark.parametrize("scheme", [None, "W8A16"])
def test_the_observing_forward_ends_at_the_output_projection_with_the_same_scales(scheme, monkeypatch):
    """Calibrating the cache needs each block's keys and values, not its MLP: after the first batch the
    observing forward stops at ``o_proj`` (a third of the work of each block's two runs saved, with the
    very scales and outputs of whole forwards)."""
    from layerwise.plugins.modifiers.kv_cache import KVCacheCalibration

    def run(stop: bool) -> tuple[torch.nn.Module, int]:
        if not stop:
            monkeypatch.setattr(KVCacheCalibration, "stop_points", lambda self, modules: None)
        model = build_tiny_llama()
        calls = []
        model.model.layers[0].mlp.register_forward_pre_hook(lambda m, a: calls.append(1))
        layerwise.compress(model, kv_recipe("fp8_head", scheme), dataset=DATA, show_progress=False)
        monkeypatch.undo()
        assert model.layerwise_report.pieces.startswith("blocks")
        return model, len(calls)

    (early, early_calls), (whole, whole_calls) = run(True), run(False)
    # whole forwards: each batch observed, then with the FP8 cache (and one replay checking the cut); ending at
    # o_proj, every observed batch but the first (which learns where to stop) skips the MLP
    assert whole_calls >= 2 * len(DATA) and early_calls == whole_calls - (len(DATA) - 1)
    for name, attention in quantized_attention(whole).items():
        other = quantized_attention(early)[name]
        assert torch.equal(attention._buffers["k_scale"], other._buffers["k_scale"])
        assert torch.equal(attention._buffers["v_scale"], other._buffers["v_scale"])
    with torch.no_grad():
        assert torch.equal(early(IDS).logits, whole(IDS).logits)
