"""compress() end to end on tiny models: data-free RTN, saving, reload, errors."""

import json

import pytest
import torch

import layerwise
from layerwise.errors import DatasetError
from tests.conftest import build_tiny_llama

WIDE = dict(hidden_size=128, intermediate_size=256)  # group size 128 must divide every in_features


@pytest.fixture
def wide_llama_dir(tmp_path):
    from tests.conftest import make_word_tokenizer

    model = build_tiny_llama(**WIDE)
    folder = tmp_path / "wide-llama"
    model.save_pretrained(folder)
    make_word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def _linear_names(model):
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def test_preset_quantizes_every_linear_but_the_head():
    model = build_tiny_llama(**WIDE)
    original = {n: p.clone() for n, p in model.named_parameters()}
    out = layerwise.compress(model, "W4A16", show_progress=False, device="cpu")
    assert out is model
    report = model.layerwise_report
    assert set(report.compressed_modules) == _linear_names(model) - {"lm_head"}
    assert report.pipeline == "datafree"
    assert report.bytes_after < report.bytes_before
    assert torch.equal(model.lm_head.weight, original["lm_head.weight"])
    changed = [n for n in report.compressed_modules if not torch.equal(
        model.get_submodule(n).weight, original[f"{n}.weight"])]
    assert changed == report.compressed_modules


def test_folder_in_folder_out_reloads_with_transformers(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    out_dir = tmp_path / "out"
    model = layerwise.compress(str(tiny_llama_dir), "W8A16", output_dir=out_dir, show_progress=False, device="cpu")
    config = json.loads((out_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert (out_dir / "recipe.yaml").is_file()
    assert "W8A16" in (out_dir / "recipe.yaml").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(out_dir).eval()
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


def test_calibrated_recipe_without_data_is_a_clear_error():
    with pytest.raises(DatasetError, match="GPTQModifier needs calibration data"):
        layerwise.compress(build_tiny_llama(), "GPTQModifier:\n  scheme: W4A16\n", show_progress=False, device="cpu")


def test_existing_output_folder_is_never_overwritten_silently(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")
    with pytest.raises(Exception, match="overwrite"):
        layerwise.compress(build_tiny_llama(**WIDE), "W4A16", output_dir=out_dir, show_progress=False, device="cpu")
    assert (out_dir / "keep.txt").read_text() == "mine"


def test_gptq_recipe_on_text_data_runs_sequentially(wide_llama_dir, tmp_path):
    texts = [" ".join(f"w{(i * 7 + j) % 100}" for j in range(40)) for i in range(8)]
    recipe = "GPTQModifier:\n  scheme: W4A16\n  ignore: [lm_head]\n"
    model = layerwise.compress(str(wide_llama_dir), recipe, dataset=texts, max_seq_length=32,
                               num_calibration_samples=8, output_dir=tmp_path / "gptq", show_progress=False, device="cpu")
    report = model.layerwise_report
    assert report.pipeline == "sequential"
    assert report.calibration_samples == 8
    assert len(report.compressed_modules) == 14  # 2 layers x 7 Linear
    assert (tmp_path / "gptq" / "layerwise_summary.json").is_file()  # the per-layer log is in it


@pytest.mark.parametrize("per_subgraph,pieces", [(1, 3), (2, 2)])
def test_targets_per_subgraph_groups_blocks_into_fewer_pieces(per_subgraph, pieces, monkeypatch):
    from layerwise.host.lifecycle import Lifecycle

    seen = []
    original = Lifecycle.sequential_epoch_end
    monkeypatch.setattr(Lifecycle, "sequential_epoch_end",
                        lambda self, modules: (seen.append(modules), original(self, modules))[1])
    batches = [{"input_ids": torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i))}
               for i in range(2)]
    model = layerwise.compress(build_tiny_llama(**WIDE), "GPTQModifier:\n  scheme: W4A16\n", dataset=batches, show_progress=False, options=layerwise.CompressOptions.of(targets_per_subgraph=per_subgraph, pieces="blocks"), device="cpu")
    assert model.layerwise_report.pipeline == "sequential"
    assert model.layerwise_report.pieces.startswith("blocks: ")
    assert len(seen) == pieces
    assert sum(any(m.startswith("model.layers.") for m in piece) for piece in seen) == 2 // per_subgraph


@pytest.mark.parametrize("context,expected", [(16, 16), (4096, 2048)])
def test_calibration_windows_default_to_the_models_context(wide_llama_dir, context, expected):
    from transformers import AutoConfig

    from layerwise.model_io.loading import load_model, load_tokenizer
    from layerwise.verbs.compression import default_max_seq_length

    config = AutoConfig.from_pretrained(wide_llama_dir)
    config.max_position_embeddings = context
    config.save_pretrained(wide_llama_dir)
    model = load_model(str(wide_llama_dir))
    assert default_max_seq_length(model) == expected
    lengths = []
    model.model.layers[0].register_forward_pre_hook(lambda m, a: lengths.append(a[0].shape[1]))
    texts = [" ".join(f"w{(i * 7 + j) % 100}" for j in range(60)) for i in range(4)]  # 4 x 61 tokens
    layerwise.compress(model, "GPTQ_W4A16", dataset=texts, num_calibration_samples=4, show_progress=False, options=layerwise.CompressOptions.of(tokenizer=load_tokenizer(str(wide_llama_dir))), device="cpu")
    assert lengths and max(lengths) == min(expected, 4 * 61)


def test_sizes_count_a_tied_embedding_once_as_the_saved_folder_does(tmp_path):
    tied = build_tiny_llama(tie_word_embeddings=True, **WIDE)
    embedding = tied.model.embed_tokens.weight
    assert tied.lm_head.weight is embedding
    untied_bytes = sum(p.numel() * p.element_size() for p in build_tiny_llama(**WIDE).parameters())
    out = tmp_path / "out"
    report = layerwise.compress(tied, "W4A16", output_dir=out, show_progress=False, device="cpu").layerwise_report
    assert report.bytes_before == untied_bytes - embedding.numel() * embedding.element_size()
    on_disk = sum(path.stat().st_size for path in out.glob("*.safetensors"))
    assert abs(report.bytes_after - on_disk) <= 8 * 1024  # headers and shape tensors only


def test_the_report_times_each_phase_of_a_run_from_a_folder_within_the_runs_seconds(tiny_llama_dir):
    """Where a run's time goes, phase by phase (the GPU bench reads this): the checks before it, the checkpoint
    read, the weights' finite check, tracing and the cut's check, the forwards and the modifier's own work."""
    texts = [f"sample {i} " + "word " * 40 for i in range(4)]
    recipe = "{GPTQModifier: {scheme: W4A16, strategy: channel, ignore: [lm_head]}}"
    model = layerwise.compress(str(tiny_llama_dir), recipe, dataset=texts, num_calibration_samples=4,
                               show_progress=False)
    report = model.layerwise_report
    phases = {phase: work["seconds"] for phase, work in report.accounting.items()}
    assert {"plan checks", "load", "weight check", "weights to the device", "tracing and the cut's check",
            "forward", "GPTQ Hessians", "GPTQ solves", "finalize"} <= set(phases)
    assert all(seconds >= 0 for seconds in phases.values())
    assert sum(phases.values()) <= report.seconds


def test_a_data_free_run_times_its_step_and_the_save(tiny_llama_dir, tmp_path):
    """A data-free run's work is the modifiers' step and the writing: both named, not left in 'other'; the
    summary saved in the folder is written during the save, so it stops before it."""
    import json

    model = layerwise.compress(str(tiny_llama_dir), "W8A16", output_dir=tmp_path / "out", show_progress=False)
    report = model.layerwise_report
    assert {"data-free step", "save"} <= set(report.accounting)
    assert sum(work["seconds"] for work in report.accounting.values()) <= report.seconds
    saved = json.loads((tmp_path / "out" / "layerwise_summary.json").read_text())
    assert "data-free step" in saved["accounting"] and "save" not in saved["accounting"]
