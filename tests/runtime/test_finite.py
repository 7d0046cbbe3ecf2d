"""Finite or fail: a NaN weight, a NaN calibration sample, a NaN about to be saved."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import layerwise
from layerwise.errors import NonFiniteError
from layerwise.plugins.modifiers.gptq import GPTQFallbackWarning
from layerwise.plugins.savers import compressed_tensors
from layerwise.runtime.finite import NonFiniteSampleWarning
from tests.conftest import build_tiny_llama

BAD_TOKEN = 127


def samples(count: int = 8, bad: tuple[int, ...] = ()) -> list[dict[str, torch.Tensor]]:
    """``count`` tokenized samples; those in ``bad`` hold BAD_TOKEN, which the hook below turns into NaN."""
    g = torch.Generator().manual_seed(3)
    out = []
    for i in range(count):
        ids = torch.randint(0, BAD_TOKEN, (1, 12), generator=g)
        if i in bad:
            ids[0, 5] = BAD_TOKEN
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    return out


def nan_on_bad_token(model: torch.nn.Module) -> None:
    """Embeddings of BAD_TOKEN become NaN: a sample whose activations go non-finite."""
    def hook(module, args, output):
        return output.masked_fill((args[0] == BAD_TOKEN).unsqueeze(-1), float("nan"))
    model.model.embed_tokens.register_forward_hook(hook)


def test_a_nan_weight_is_an_error_before_calibration_naming_it(tmp_path):
    model = build_tiny_llama()
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError) as info:
        layerwise.compress(model, "GPTQ_W8A16", dataset=samples(), output_dir=tmp_path / "out", show_progress=False)
    message = str(info.value)
    assert "'model.layers.0.self_attn.q_proj.weight'" in message and "non_finite='skip'" in message
    assert not (tmp_path / "out").exists()
    assert not any(hasattr(m, "weight_scale") for m in model.modules())  # nothing was calibrated


def test_skip_leaves_the_module_uncompressed_and_lists_it(tmp_path, capsys):
    model = build_tiny_llama()
    bad = "model.layers.1.mlp.down_proj"
    with torch.no_grad():
        model.get_submodule(bad).weight[2, 3] = float("inf")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GPTQFallbackWarning)
        layerwise.compress(model, "GPTQ_W8A16", dataset=samples(), output_dir=tmp_path / "out", show_progress=False, options=layerwise.CompressOptions.of(non_finite="skip"))
    report = model.layerwise_report
    assert report.skipped_non_finite == [bad]
    assert bad not in report.compressed_modules and "model.layers.1.mlp.up_proj" in report.compressed_modules
    assert not hasattr(model.get_submodule(bad), "weight_scale")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert bad in config["quantization_config"]["ignore"]
    # the saved run says so too, as the compress summary does
    from layerwise.cli import main

    main(["report", str(tmp_path / "out")])
    assert f"left uncompressed:  1 with NaN/inf weights ({bad})" in capsys.readouterr().out


def test_a_nan_sample_is_dropped_by_name_and_the_rest_is_gptq(recwarn):
    model = build_tiny_llama()
    nan_on_bad_token(model)
    layerwise.compress(model, "GPTQ_W8A16", dataset=samples(bad=(3,)), show_progress=False)
    dropped = [str(w.message) for w in recwarn if issubclass(w.category, NonFiniteSampleWarning)]
    assert any(m.startswith("calibration sample 3: its activations became NaN or inf in subgraph 0") for m in dropped)
    assert not [w for w in recwarn if issubclass(w.category, GPTQFallbackWarning)]
    records = model.layerwise_report.layer_log
    assert len(records) == 14 and all(r["method"] == "gptq" for r in records)
    assert all(r["tokens"] == 7 * 12 for r in records)  # the bad sample in none of the Hessians
    for module in model.modules():
        scale = getattr(module, "weight_scale", None)
        assert scale is None or bool(torch.isfinite(scale).all())
    clean = samples(1)[0]
    assert bool(torch.isfinite(model(**clean).logits).all())


def test_every_sample_non_finite_is_a_named_error(tmp_path):
    model = build_tiny_llama()
    nan_on_bad_token(model)
    with pytest.raises(NonFiniteError, match="NaN or inf"):
        layerwise.compress(model, "GPTQ_W8A16", dataset=samples(4, bad=(0, 1, 2, 3)),
                           output_dir=tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists()


def test_a_non_finite_tensor_to_be_saved_writes_nothing(tmp_path, monkeypatch):
    real = compressed_tensors.compressed_state_dict

    def poisoned(model, modules):
        state = real(model, modules)
        state["model.layers.1.self_attn.o_proj.weight_scale"][0] = float("nan")
        return state

    monkeypatch.setattr(compressed_tensors, "compressed_state_dict", poisoned)
    with pytest.raises(NonFiniteError) as info:
        layerwise.compress(build_tiny_llama(), "W8A16", output_dir=tmp_path / "out", show_progress=False)
    assert "'model.layers.1.self_attn.o_proj.weight_scale'" in str(info.value) and "nothing was written" in str(info.value)
    assert list(tmp_path.iterdir()) == []


def test_gptq_names_a_layer_whose_own_weight_is_not_finite():
    from layerwise.host.plugin_manager import registry
    from tests.plugins.pipelines.helpers import make_lifecycle

    model = build_tiny_llama()
    modifier = registry("modifiers").get("GPTQModifier")(scheme="W8A16")
    make_lifecycle(model, modifier)
    name = "model.layers.0.mlp.gate_proj"
    with torch.no_grad():
        model.get_submodule(name).weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=f"the weight of layer '{name}' itself holds 1 NaN/inf"):
        modifier.quantize_module(name, model.get_submodule(name))


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16, torch.float32])
def test_is_finite_reads_every_code_of_small_floats(dtype):
    from layerwise.runtime.finite import is_finite

    if dtype.itemsize == 1:  # every bit pattern of the type, against torch's own isfinite
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
        for code in codes:
            assert is_finite(code.reshape(1)) == bool(torch.isfinite(code.to(torch.float32))), code
    values = torch.linspace(-3, 3, 64).to(dtype)
    assert is_finite(values)
    for bad in (float("nan"), float("-nan"), float("inf")):
        poisoned = values.to(torch.float32).clone()
        poisoned[17] = bad
        cast = poisoned.to(dtype)  # (float8 e4m3fn has no inf: torch's cast of inf is its NaN)
        assert is_finite(cast) == bool(torch.isfinite(cast.to(torch.float32)).all())
        assert not is_finite(cast) or dtype == torch.float8_e4m3fn
