"""Model-free compression: the bytes an in-memory data-free run saves, without a model class, shard by shard."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import layerwise
from layerwise.model_io.model_free import ModelFreeError, compress_model_free
from layerwise.model_io.saving import OutputExistsError, OutputIsInputError

G32 = "{QuantizationModifier: {scheme: W4A16, group_size: 32}}"
RECIPES = {
    "W4A16_G32": G32,
    "W4A16_ASYM_G32": "{QuantizationModifier: {scheme: W4A16_ASYM, group_size: 32}}",
    "W8A16": "W8A16",
    "W8A8": "W8A8",
    "FP8_DYNAMIC": "FP8_DYNAMIC",
}


def _save_llama(folder: Path, shard: str | None = "100KB", **overrides) -> Path:
    from tests.conftest import build_tiny_llama, make_word_tokenizer

    model = build_tiny_llama(**overrides).to(torch.bfloat16)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    make_word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


@pytest.fixture
def sharded_llama(tmp_path):
    folder = _save_llama(tmp_path / "llama")
    assert len(list(folder.glob("*.safetensors"))) >= 2
    return folder


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        found.update(load_file(file))
    return found


def _assert_same_output(model_free: Path, in_memory: Path) -> None:
    a, b = _tensors(model_free), _tensors(in_memory)
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    config_a = json.loads((model_free / "config.json").read_text())["quantization_config"]
    config_b = json.loads((in_memory / "config.json").read_text())["quantization_config"]
    assert config_a == config_b


@pytest.mark.parametrize("name", list(RECIPES))
def test_bit_identical_to_the_in_memory_run(sharded_llama, tmp_path, name):
    recipe = RECIPES[name]
    report = compress_model_free(sharded_llama, recipe, tmp_path / "free", workers=2 if name == "W4A16_G32" else 1)
    layerwise.compress(str(sharded_llama), recipe, output_dir=tmp_path / "memory", show_progress=False,
                       options=layerwise.CompressOptions.of(weights="memory"))
    _assert_same_output(tmp_path / "free", tmp_path / "memory")
    assert len(report.compressed_modules) == 14 and report.pipeline == "model-free"
    index = json.loads((tmp_path / "free" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(p.name for p in sharded_llama.glob("*.safetensors"))


@pytest.mark.parametrize("recipe", [RECIPES["W4A16_G32"], "NVFP4A16"])
def test_a_one_file_model_gives_the_in_memory_run_s_file_byte_for_byte(tmp_path, recipe):
    """Tensors in the order the safetensors package writes them (by dtype, then name), so the file itself is the
    same bytes as the in-memory saver's."""
    folder = _save_llama(tmp_path / "llama", shard=None)
    compress_model_free(folder, recipe, tmp_path / "free")
    layerwise.compress(str(folder), recipe, output_dir=tmp_path / "memory", show_progress=False,
                       options=layerwise.CompressOptions.of(weights="memory"))
    free, memory = (tmp_path / side / "model.safetensors" for side in ("free", "memory"))
    assert free.read_bytes() == memory.read_bytes()


#: every data-free preset a chunked layer can take, and the observers' row independence with them
CHUNKED = [RECIPES["W4A16_ASYM_G32"], "W8A8", "FP8_DYNAMIC", "FP8_BLOCK", "NVFP4A16", "MXFP4A16", "MXFP8A16",
           "{QuantizationModifier: {config_groups: {g: {targets: [Linear], weights: {num_bits: 8, strategy: tensor}}}, "
           "ignore: [lm_head]}}",
           "{QuantizationModifier: {config_groups: {g: {targets: [Linear], weights: {num_bits: 8, symmetric: false, "
           "strategy: channel}}}, ignore: [lm_head]}}"]


@pytest.mark.parametrize("recipe", CHUNKED)
def test_layers_quantized_in_chunks_of_rows_write_the_in_memory_bytes(tmp_path, monkeypatch, recipe):
    from layerwise.model_io.model_free import worker

    # 320-row MLP layers in chunks of 128 rows (the last 64): the chunked path, its remainder, and packed
    # zero points, FP8 tiles and NVFP4 global scales across chunks; int8 asymmetric (the last recipe) keeps the
    # in-memory run's fake-quantized round trip (worker.codes_survive_storage)
    block = recipe == "FP8_BLOCK"  # its inputs' groups of 128 must divide every layer's width
    folder = _save_llama(tmp_path / "llama", intermediate_size=384 if block else 320, hidden_size=128 if block else 64)
    monkeypatch.setattr(worker, "CHUNK_ELEMENTS", 128 * 64)
    chunked = []
    original = worker.chunk_rows
    monkeypatch.setattr(worker, "chunk_rows", lambda *a: chunked.append(original(*a)) or chunked[-1])
    compress_model_free(folder, recipe, tmp_path / "free", workers=2)
    layerwise.compress(str(folder), recipe, output_dir=tmp_path / "memory", show_progress=False,
                       options=layerwise.CompressOptions.of(weights="memory"))
    _assert_same_output(tmp_path / "free", tmp_path / "memory")
    assert (128 in chunked) != ("strategy: tensor" in recipe)  # per-tensor ranges take the layer whole


def test_nvfp4_global_scales_are_shared_by_the_projections_vllm_fuses(sharded_llama, tmp_path):
    compress_model_free(sharded_llama, "NVFP4A16", tmp_path / "free", workers=2)
    tensors = _tensors(tmp_path / "free")
    source = _tensors(sharded_llama)
    attention = [tensors[f"model.layers.0.self_attn.{p}_proj.weight_global_scale"] for p in "qkv"]
    assert torch.equal(attention[0], attention[1]) and torch.equal(attention[0], attention[2])
    gate, up = (tensors[f"model.layers.0.mlp.{p}_proj.weight_global_scale"] for p in ("gate", "up"))
    assert torch.equal(gate, up)
    amax = max(source[f"model.layers.0.mlp.{p}_proj.weight"].abs().amax().float() for p in ("gate", "up"))
    assert torch.allclose(gate, 448 * 6 / amax)  # FP8 max x FP4 max over the pair's largest magnitude
    down = tensors["model.layers.0.mlp.down_proj.weight_global_scale"]
    assert torch.allclose(down, 448 * 6 / source["model.layers.0.mlp.down_proj.weight"].abs().amax().float())


def _wq_scales(folder: Path) -> list[torch.Tensor]:
    tensors = _tensors(folder)
    return [tensors[f"model.layers.0.self_attn.{p}.weight_global_scale"] for p in ("wq", "wk", "wv")]


def test_nvfp4_shares_the_global_scales_the_patch_matched_from_config_json_declares(register_plugin, tmp_path):
    from tests.wq_llama import MODEL_TYPE, WqPlugin, save_wq_llama

    folder = save_wq_llama(tmp_path / "wq")
    assert json.loads((folder / "config.json").read_text())["model_type"] == MODEL_TYPE
    source = _tensors(folder)
    own = [448 * 6 / source[f"model.layers.0.self_attn.{p}.weight"].abs().amax().float() for p in ("wq", "wk", "wv")]
    compress_model_free(folder, "NVFP4A16", tmp_path / "alone", workers=1)
    alone = _wq_scales(tmp_path / "alone")  # no patch knows the architecture: three layers of their own
    assert all(torch.allclose(scale, expected) for scale, expected in zip(alone, own))
    assert len({scale.item() for scale in alone}) == 3

    register_plugin(WqPlugin(), "wq-llama")
    compress_model_free(folder, "NVFP4A16", tmp_path / "fused", workers=2)
    fused = _wq_scales(tmp_path / "fused")
    assert all(torch.equal(scale, fused[0]) for scale in fused) and torch.allclose(fused[0], min(own))
    tensors = _tensors(tmp_path / "fused")
    assert torch.equal(tensors["model.layers.0.mlp.gate_proj.weight_global_scale"],
                       tensors["model.layers.0.mlp.up_proj.weight_global_scale"])  # the default table still holds
    # matched by model_type alone when no class name matches; patch=False keeps the default table only
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["SomethingElse"]}))
    compress_model_free(folder, "NVFP4A16", tmp_path / "by-type", workers=1)
    assert all(torch.equal(a, b) for a, b in zip(_wq_scales(tmp_path / "by-type"), fused))
    compress_model_free(folder, "NVFP4A16", tmp_path / "none", workers=1, patch=False)
    assert all(torch.equal(a, b) for a, b in zip(_wq_scales(tmp_path / "none"), alone))


def test_nvfp4_with_a_patchs_fused_projections_is_bit_identical_to_the_in_memory_run(register_plugin, tmp_path):
    from tests.wq_llama import WqPlugin, build_wq_llama, save_wq_llama

    register_plugin(WqPlugin(), "wq-llama")
    folder = save_wq_llama(tmp_path / "wq")
    compress_model_free(folder, "NVFP4A16", tmp_path / "free", workers=2)
    layerwise.compress(build_wq_llama(), "NVFP4A16", output_dir=tmp_path / "memory", show_progress=False)
    _assert_same_output(tmp_path / "free", tmp_path / "memory")
    scales = _wq_scales(tmp_path / "free")
    assert all(torch.equal(scale, scales[0]) for scale in scales)


def test_compress_with_weights_model_free_is_the_same_run(sharded_llama, tmp_path):
    report = layerwise.compress(str(sharded_llama), G32, output_dir=tmp_path / "out", show_progress=False,
                                options=layerwise.CompressOptions.of(weights="model-free", workers=1))
    assert report.pipeline == "model-free" and (tmp_path / "out" / "layerwise_summary.json").is_file()
    assert (tmp_path / "out" / "tokenizer.json").is_file() and (tmp_path / "out" / "recipe.yaml").is_file()
    assert layerwise.CompressOptions.of(weights="model-free").as_dict()["weights"] == "model-free"
    # the summary records the settings the run used (it recorded none: {})
    saved = json.loads((tmp_path / "out" / "layerwise_summary.json").read_text())
    assert saved["options"]["weights"] == "model-free" and saved["options"]["workers"] == 1
    assert saved["options"]["save_format"] == "compressed-tensors" and saved["options"]["ignore"] is None


def test_a_recipe_file_in_the_output_folder_is_refused_before_any_work(sharded_llama, tmp_path):
    """overwrite='any' replaces a folder that is not a layerwise output, but never one holding an input: the
    model-free run checked the model folder only and deleted the recipe file."""
    from layerwise.errors import LayerwiseError

    out = tmp_path / "out"
    out.mkdir()
    recipe = out / "recipe.yaml"
    recipe.write_text("QuantizationModifier:\n  scheme: W4A16\n  group_size: 32\n")
    with pytest.raises(LayerwiseError, match="recipe file"):
        compress_model_free(sharded_llama, str(recipe), out, overwrite="any", workers=1)
    assert recipe.is_file() and sorted(p.name for p in out.iterdir()) == ["recipe.yaml"]
    options = layerwise.CompressOptions.of(weights="model-free", overwrite="any")
    plan = layerwise.plan(str(sharded_llama), str(recipe), output_dir=out, options=options)
    assert not plan.ok and any("recipe file" in finding.text for finding in plan.findings)


def test_an_architecture_transformers_does_not_know(tmp_path):
    folder = _save_llama(tmp_path / "mystery", shard=None)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mystery-lm", architectures=["MysteryForCausalLM"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception):  # noqa: B017 - what a model class would need: transformers refuses it
        layerwise.load_model(str(folder))
    report = compress_model_free(folder, G32, tmp_path / "out", workers=1)
    out = tmp_path / "out"
    saved = json.loads((out / "config.json").read_text())
    assert saved["model_type"] == "mystery-lm" and saved["quantization_config"]["ignore"] == ["lm_head"]
    tensors = _tensors(out)
    assert "model.layers.0.mlp.down_proj.weight_packed" in tensors and "lm_head.weight" in tensors
    assert tensors["model.embed_tokens.weight"].dtype == torch.bfloat16  # embeddings are not Linear layers
    assert len(report.compressed_modules) == 14


def test_the_output_reloads_with_transformers_as_the_in_memory_output_does(sharded_llama, tmp_path):
    from transformers import AutoModelForCausalLM

    compress_model_free(sharded_llama, "W8A16", tmp_path / "free", workers=1)
    layerwise.compress(str(sharded_llama), "W8A16", output_dir=tmp_path / "memory", show_progress=False,
                       options=layerwise.CompressOptions.of(weights="memory"))
    ids = torch.tensor([[1, 5, 9, 2, 7]])
    logits = [AutoModelForCausalLM.from_pretrained(tmp_path / which).eval()(ids).logits
              for which in ("free", "memory")]
    assert torch.equal(logits[0], logits[1])


def test_targets_and_ignore_are_patterns_on_tensor_names_with_did_you_mean(sharded_llama, tmp_path):
    only_mlp = "{QuantizationModifier: {scheme: W8A16, targets: ['re:.*mlp\\..*_proj'], ignore: [lm_head]}}"
    report = compress_model_free(sharded_llama, only_mlp, tmp_path / "mlp", workers=1)
    assert sorted(report.compressed_modules) == sorted(f"model.layers.{i}.mlp.{p}_proj" for i in range(2)
                                                       for p in ("gate", "up", "down"))
    config = json.loads((tmp_path / "mlp" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.q_proj" in config["ignore"]  # the loader leaves them dense
    typo = "{QuantizationModifier: {scheme: W8A16, targets: [model.layers.0.mlp.down_prj]}}"
    with pytest.raises(ModelFreeError, match="did you mean 'model.layers.0.mlp.down_proj'"):
        compress_model_free(sharded_llama, typo, tmp_path / "typo")
    with pytest.raises(ModelFreeError, match="class name.*pattern"):
        compress_model_free(sharded_llama, "{QuantizationModifier: {scheme: W8A16, targets: [LlamaMLP]}}",
                            tmp_path / "class")
    with pytest.raises(ModelFreeError, match="GPTQModifier cannot run model-free.*calibration data"):
        compress_model_free(sharded_llama, "GPTQ_W8A16", tmp_path / "gptq")
    with pytest.raises(ModelFreeError, match="group_size 128 does not divide in_features 64"):
        compress_model_free(sharded_llama, "W4A16", tmp_path / "g128")
    assert not any((tmp_path / name).exists() for name in ("typo", "class", "gptq", "g128"))


def test_the_runs_own_ignore_entries_must_match_and_sequential_targets_are_refused(sharded_llama, tmp_path):
    """``--ignore`` must match a layer (a typo would quantize the layer meant to stay dense); ``--targets``
    (where a calibrated run cuts) has no meaning without a model, and is refused rather than dropped."""
    options = layerwise.CompressOptions.of(weights="model-free", ignore=["re:.*down_prj"])
    with pytest.raises(ModelFreeError, match=r"ignore entry 're:\.\*down_prj' matches no layer.*'re:\.\*down_proj'"):
        layerwise.compress(str(sharded_llama), "W8A16", output_dir=tmp_path / "typo", options=options)
    options = layerwise.CompressOptions.of(weights="model-free", sequential_targets=["LlamaDecoderLayer"])
    with pytest.raises(ModelFreeError, match="sequential targets.*model-free run builds no model"):
        layerwise.compress(str(sharded_llama), "W8A16", output_dir=tmp_path / "targets", options=options)
    assert not (tmp_path / "typo").exists() and not (tmp_path / "targets").exists()


def test_a_recipe_ignore_entry_matching_no_layer_is_warned_about(sharded_llama, tmp_path):
    from layerwise.common.matching import IgnoreWarning

    recipe = "{QuantizationModifier: {scheme: W8A16, ignore: [lm_head, 're:.*down_prj']}}"
    with pytest.warns(IgnoreWarning, match=r"'re:\.\*down_prj' matches no layer.*did you mean 're:\.\*down_proj'"):
        compress_model_free(sharded_llama, recipe, tmp_path / "out", workers=1)


def test_a_folder_too_large_for_the_memory_is_refused_before_any_work(sharded_llama, tmp_path, monkeypatch):
    from layerwise.model_io.model_free import run

    monkeypatch.setattr(run.memory_policy, "available_memory", lambda: 64 * 1024)
    monkeypatch.setattr(run, "run_shard", lambda job: pytest.fail("a shard ran"))
    with pytest.raises(ModelFreeError, match=r"a model-free worker needs ~.* MiB .* 0.06 MiB is available"):
        compress_model_free(sharded_llama, G32, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_memory_bounds_the_workers(sharded_llama, monkeypatch):
    from layerwise.model_io.model_free import run

    shards, tensors = run._shards(sharded_llama)
    all_layers = run.layers(tensors)
    jobs = run._layer_jobs(layerwise.host.recipe.parse_recipe(G32), all_layers, [])
    by_file = {file: [job for job in jobs.values() if all_layers[job.module].file == file] for file in shards}
    need = run.worker_memory(shards, by_file, all_layers)
    largest = max(all_layers.values(), key=lambda layer: layer.rows * layer.columns)  # 128 x 64 (MLP)
    assert need >= largest.rows * largest.columns * 4 * run.WORK_COPIES
    monkeypatch.setattr(run.memory_policy, "available_memory", lambda: 2 * need)
    assert run._workers(None, shards, need) == min(2, len(shards))


def test_the_output_is_written_completely_or_not_at_all(sharded_llama, tmp_path, monkeypatch):
    from layerwise.model_io.model_free import run

    calls = []

    def fail_on_second(job):
        calls.append(job)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        return original(job)

    original = run.run_shard
    monkeypatch.setattr(run, "run_shard", fail_on_second)
    with pytest.raises(RuntimeError, match="disk full"):
        compress_model_free(sharded_llama, G32, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    with pytest.raises(OutputIsInputError):
        compress_model_free(sharded_llama, G32, sharded_llama / "inside")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        compress_model_free(sharded_llama, G32, tmp_path / "taken")
    monkeypatch.setattr(run, "run_shard", original)
    compress_model_free(sharded_llama, G32, tmp_path / "out", workers=1)
    compress_model_free(sharded_llama, G32, tmp_path / "out", workers=1, overwrite=True)  # a layerwise output


def test_the_cli_flag(sharded_llama, tmp_path, capsys):
    from layerwise.cli import main

    assert main(["compress", "--model", str(sharded_llama), "--model-free", "--recipe", "W8A16", "--output-dir",
                 str(tmp_path / "out"), "--workers", "1", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "pipeline:           model-free" in out and "modules compressed: 14" in out


def test_the_output_gets_the_model_card_in_place_of_the_source_models_readme(sharded_llama, tmp_path):
    from layerwise.reports.model_card import is_layerwise_card

    (sharded_llama / "README.md").write_text("# the original model's own card\n")
    out = tmp_path / "out"
    layerwise.compress(str(sharded_llama), "W8A16", output_dir=str(out), show_progress=False,
                       options=layerwise.CompressOptions.of(weights="model-free", workers=1))
    card = (out / "README.md").read_text()
    assert is_layerwise_card(out / "README.md") and "- compressed-tensors" in card and "- w8a16" in card
    assert (sharded_llama / "README.md").read_text() == "# the original model's own card\n"  # the input untouched


def test_loading_the_plugins_imports_no_modeling_code():
    """Patches find their opaque functions when a trace asks (LazyFunctions): registering them imports no
    transformers modeling module (seconds and ~150 MiB every model-free run, plan and CLI call paid)."""
    import subprocess
    import sys

    code = ("import sys\nfrom layerwise.host.plugin_manager import registry\nregistry('savers')\n"
            "from layerwise.model_zoo import mllama, qwen2_vl\n"
            "print(sorted(m for m in sys.modules if m.startswith('transformers.models.')))\n"
            "assert len(mllama.MLLAMA.opaque_functions) == 2\n"
            "print('modeling_mllama' in str(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = done.stdout.strip().splitlines()
    assert before == "[]" and after == "True"  # imported once a trace reads them


def test_entries_written_for_llm_compressors_prefix_match_get_the_pattern_to_write():
    """llm-compressor's 're:.*mlp' keeps each MLP's layers out (re.match matches the start); here it matches only
    the block, which holds no tensor: the ignore entry is warned about and the target refused, each with the fix."""
    from layerwise.common.matching import IgnoreWarning
    from layerwise.model_io.model_free.selection import SelectionError, warn_unmatched_ignore
    from layerwise.model_io.model_free.selection import select as select_layers

    modules = [f"model.layers.{i}.mlp.{p}_proj" for i in (0, 1) for p in ("gate", "up", "down")] + ["lm_head"]
    with pytest.warns(IgnoreWarning, match=r"'re:\.\*mlp' matches only modules without a weight "
                                           r"\('model.layers.0.mlp', 'model.layers.1.mlp'\).*write 're:\.\*mlp\\\.\.\*'"):
        warn_unmatched_ignore(["re:.*mlp"], modules, "QuantizationModifier")
    layers = dict.fromkeys(modules)
    with pytest.raises(SelectionError, match=r"target 're:\.\*mlp' matches no layer.*only blocks holding layers "
                                             r"\('model.layers.0.mlp', ...\).*write 're:\.\*mlp\\\.\.\*'"):
        select_layers(layers, ["re:.*mlp"], [], "QuantizationModifier")
