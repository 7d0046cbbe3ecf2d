"""RotationModifier through compress(): the function kept, composed with quantizers, saved and reloaded."""

import pytest
import torch

import layerwise
from layerwise.errors import RecipeError
from layerwise.plugin.quantization import RotationError
from layerwise.plugins.modifiers.rotation import RotationModifier
from layerwise.recipe import parse_recipe
from tests.conftest import build_tiny_llama


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("build", [build_tiny_llama, _tiny_qwen2], ids=["llama-patch", "qwen2-default-layout"])
def test_rotation_alone_keeps_the_model_s_outputs(build):
    model = build()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    modifier = RotationModifier(rotation="orthogonal", seed=3)
    layerwise.compress(model, modifier, show_progress=False)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
    assert len(modifier.rotated["writers"]) == 4 and modifier.rotated["norms"][-1] == "model.norm"
    assert any(r.get("modifier") == "RotationModifier" for r in model.layerwise_report.layer_log)


def test_quarot_gptq_w4a8_preset_saves_a_checkpoint_that_reloads(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_tiny_llama(tie_word_embeddings=True, hidden_size=128, intermediate_size=256)
    samples = [{"input_ids": torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i))}
               for i in range(16)]
    modifiers = parse_recipe("QUAROT_GPTQ_W4A8")
    assert [type(m).__name__ for m in modifiers] == ["RotationModifier", "GPTQModifier"]
    out = tmp_path / "quarot"
    model = layerwise.compress(model, "QUAROT_GPTQ_W4A8", dataset=samples, output_dir=out, show_progress=False,
                               device="cpu")
    down = model.model.layers[0].mlp.down_proj
    assert down.quantization_args.num_bits == 4 and down.input_quantization_args.num_bits == 8
    assert "inputs online" not in (out / "README.md").read_text()  # nothing online: plain transformers loads it
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("quantizer", ["QuantizationModifier", "AutoRoundModifier"])
def test_rotation_composes_before_rtn_and_autoround(tmp_path, quantizer):
    from transformers import AutoModelForCausalLM

    from layerwise.plugins.modifiers.autoround import AutoRoundModifier
    from layerwise.plugins.modifiers.quantization import QuantizationModifier

    model = build_tiny_llama()
    samples = [{"input_ids": torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i))}
               for i in range(4)]
    second = (QuantizationModifier(scheme="W4A16", group_size=32) if quantizer == "QuantizationModifier"
              else AutoRoundModifier(scheme="W4A16", group_size=32, iters=2, batch_size=2))
    out = tmp_path / quantizer
    model = layerwise.compress(model, [RotationModifier(), second], dataset=samples, output_dir=out,
                               show_progress=False, device="cpu")
    assert model.model.layers[0].self_attn.q_proj.quantization_args.num_bits == 4
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(reloaded, ids), _logits(model, ids), rtol=1e-4, atol=1e-4)


def test_recipe_fields_and_errors():
    (modifier,) = parse_recipe("RotationModifier:\n  rotation: orthogonal\n  seed: 7\n")
    assert modifier.to_dict() == {"RotationModifier": {"rotation": "orthogonal", "seed": 7, "online": False,
                                                     "block_size": None, "heads": False,
                                                     "online_signs": False}}
    with pytest.raises(RecipeError, match="did you mean 'hadamard'"):
        RotationModifier(rotation="hadamrd")
    (modifier,) = parse_recipe("RotationModifier:\n  online: true\n  block_size: 64\n")
    assert modifier.online and modifier.block_size == 64
    with pytest.raises(RecipeError, match="block_size must be a power of two"):
        RotationModifier(online=True, block_size=96)
    with pytest.raises(RecipeError, match="set online: true"):
        RotationModifier(block_size=64)
    with pytest.raises(RecipeError, match="heads must be true or false"):
        RotationModifier(heads="yes")
    with pytest.raises(RecipeError, match="online_signs must be true or false"):
        RotationModifier(online=True, online_signs=1)


def test_a_family_without_a_layout_is_told_to_declare_one_not_to_fix_its_recipe():
    import dataclasses
    import re

    from layerwise.model_zoo.llava import LLAVA

    # the Llama-like default finds Llava's embeddings and writers, not its text tower's final norm (once worded
    # as a mapping "of the recipe", which RotationModifier does not have)
    undeclared = dataclasses.replace(LLAVA, rotation_layout=None)
    with pytest.raises(RotationError, match=re.escape(repr(r"re:^model\.norm$")) + r" of the rotation layout match "
                       r"no module of LlavaForConditionalGeneration; declare rotation_layout in its model patch .*'llava' "
                       r"declares none, so the Llama-like default layout was tried") as raised:
        layerwise.compress(LLAVA.tiny_models[0](), RotationModifier(), show_progress=False,
                           options=layerwise.CompressOptions.of(patch=undeclared))
    assert "recipe" not in str(raised.value)


def test_a_base_model_without_its_head_is_told_the_rotation_would_come_out_rotated():
    """LlamaModel matches the llama patch, whose layout is right: what is missing is the head, not a layout."""
    from transformers import LlamaModel

    from tests.conftest import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaModel(tiny_llama_config()).eval()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    with pytest.raises(RotationError) as raised:
        layerwise.compress(model, RotationModifier(), show_progress=False)
    message = str(raised.value)
    assert "LlamaModel has no language-model head for the rotation to end in" in message
    assert "the last hidden state would come out rotated" in message
    assert "AutoModelForCausalLM rather than AutoModel" in message and "leave RotationModifier out" in message
    assert "declare rotation_layout" not in message
    assert all(torch.equal(before[name], p) for name, p in model.state_dict().items())  # refused before any change


def _quarot_w4(tmp_path, recipe, name="quarot"):
    model = build_tiny_llama(tie_word_embeddings=True, hidden_size=128, intermediate_size=256)
    samples = [{"input_ids": torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i))}
               for i in range(16)]
    out = tmp_path / name
    model = layerwise.compress(model, recipe, dataset=samples, output_dir=out, show_progress=False, device="cpu")
    return model, out


def test_online_rotation_keeps_the_outputs_and_is_logged():
    model = build_tiny_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    modifier = RotationModifier(online=True, heads=True)
    layerwise.compress(model, modifier, show_progress=False)
    torch.testing.assert_close(_logits(model, ids), before, rtol=1e-4, atol=1e-4)
    assert modifier.rotated["online"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert modifier.rotated["heads"] == ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"]
    assert "online_signs" not in modifier.rotated  # Sylvester's Hadamard unless asked


def test_online_signs_differ_only_by_the_signs_folded_into_up_and_down():
    plain, signed = build_tiny_llama(), build_tiny_llama()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    before = _logits(plain, ids)
    layerwise.compress(plain, RotationModifier(online=True), show_progress=False)
    flipping = RotationModifier(online=True, online_signs=True)
    layerwise.compress(signed, flipping, show_progress=False)
    assert flipping.rotated["online_signs"] == flipping.rotated["online"]
    torch.testing.assert_close(_logits(signed, ids), before, rtol=1e-4, atol=1e-4)
    up, up_signed = plain.model.layers[0].mlp.up_proj.weight, signed.model.layers[0].mlp.up_proj.weight
    signs = up_signed[:, 0] / up[:, 0]
    assert set(signs.tolist()) == {-1.0, 1.0} and torch.equal(up_signed, up * signs.unsqueeze(1))
    for name in ("gate_proj",):  # nothing else in the MLP moves
        assert torch.equal(getattr(plain.model.layers[0].mlp, name).weight,
                           getattr(signed.model.layers[0].mlp, name).weight)


def test_quarot_gptq_w4a4_saves_transform_config_and_load_compressed_reproduces_it_exactly(tmp_path):
    import json

    from compressed_tensors.transform import TransformConfig
    from transformers import AutoModelForCausalLM

    from layerwise.algorithms.quantization.online_rotation import online_hadamards

    model, out = _quarot_w4(tmp_path, "QUAROT_GPTQ_W4A4")
    down = model.model.layers[0].mlp.down_proj
    assert down.quantization_args.num_bits == 4 and down.input_quantization_args.num_bits == 4
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    groups = TransformConfig.model_validate(quant["transform_config"]).config_groups
    assert groups["R4"].apply[0].targets == sorted(online_hadamards(model))
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = _logits(model, ids)
    reloaded = layerwise.load_compressed(out).eval()
    assert sorted(online_hadamards(reloaded)) == sorted(online_hadamards(model))
    card = (out / "README.md").read_text()
    assert "rotates some layers' inputs online" in card  # the model card warns, and its code block to copy loads
    assert f'model = layerwise.load_compressed("{out.name}")' in card and "from_pretrained(" not in card  # it right
    assert torch.equal(_logits(reloaded, ids), expected)  # bit for bit
    # transformers 5.x drops transform_config: a plain load has no online rotation and other outputs
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not online_hadamards(plain) and not any(plain.model.layers[0].mlp.down_proj._forward_pre_hooks)
    assert (_logits(plain, ids) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("block_size", [None, 64])
def test_compressed_tensors_apply_transform_config_reproduces_it_at_float_rounding(tmp_path, block_size):
    import json

    from compressed_tensors.transform import apply_transform_config
    from transformers import AutoModelForCausalLM

    from layerwise.algorithms.quantization.online_rotation import online_only
    from layerwise.plugins.modifiers.gptq import GPTQModifier

    # weight-only, so no 4-bit input bin can flip on the last bit of a float32 rounding difference
    model, out = _quarot_w4(tmp_path, [RotationModifier(online=True, block_size=block_size),
                                       GPTQModifier(scheme="W4A16")])
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    expected = _logits(model, ids)
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    assert quant["transform_config"]["config_groups"]["R4"]["head_dim"] == block_size
    apply_transform_config(plain, online_only(quant["transform_config"]))
    torch.testing.assert_close(_logits(plain, ids), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(_logits(layerwise.load_compressed(out).eval(), ids), expected)


def test_calibration_hooks_see_the_rotated_inputs_of_down_proj():
    from layerwise.algorithms.quantization.hadamard import fwht
    from tests.plugins.pipelines.helpers import RoundingModifier

    model = build_tiny_llama()
    sample = {"input_ids": torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))}
    plain = []
    handle = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, a: plain.append(a[0].detach()))
    _logits(model, sample["input_ids"])
    handle.remove()
    recorder = RoundingModifier(grid=1e-30)
    layerwise.compress(model, [RotationModifier(online=True), recorder], dataset=[sample],
                       show_progress=False, device="cpu")  # compared with the CPU forward's inputs
    seen = recorder.seen["model.layers.0.mlp.down_proj"][0]
    torch.testing.assert_close(seen, fwht(plain[0]), rtol=1e-4, atol=1e-5)
    assert (seen - plain[0]).abs().max() > 1e-2  # rotated, not the plain input


def test_smoothing_after_an_online_rotation_skips_the_rotated_layer_s_mapping():
    from layerwise.algorithms.quantization.mappings import mappings_for_run
    from layerwise.algorithms.quantization.online_rotation import rotate_inputs_online
    from layerwise.plugin import registry

    model = build_tiny_llama()
    patch = registry("model_patches").get("llama")
    before = {m.smoothed for m in mappings_for_run(model, patch, None, owner="AWQModifier")}
    assert "model.layers.0.mlp.up_proj" in before
    rotate_inputs_online(model, ["re:.*mlp\\.down_proj$"])
    after = {m.smoothed for m in mappings_for_run(model, patch, None, owner="AWQModifier")}
    assert after == {s for s in before if not s.endswith("up_proj")}
