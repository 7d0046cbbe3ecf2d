"""compress(weights="stream"): the same checkpoint as an in-memory run, with one piece loaded at a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import layerwise
from layerwise.errors import InvalidArgumentError, NonFiniteError
from layerwise.model_io.streaming import StreamingError, build_streamed_model
from layerwise.model_io.streaming.checkpoint import CheckpointError
from layerwise.model_io.streaming.stream import WeightStream
from layerwise.runtime.placeholders import is_unloaded
from tests.conftest import build_tiny_llama, make_word_tokenizer

HIDDEN = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, vocab_size=256)


def _save(folder: Path, tie: bool = True, shard: str | None = "200KB") -> Path:
    model = build_tiny_llama(seed=3, tie_word_embeddings=tie, **HIDDEN)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    make_word_tokenizer(model.config.vocab_size).save_pretrained(folder)
    return folder


def _samples(count: int = 4) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(0, HIDDEN["vocab_size"], (1, 24), generator=generator)} for _ in range(count)]


def _saved(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("recipe", ["GPTQ_W4A16", "SQ_GPTQ_W8A8", "W4A16"])
def test_streamed_run_writes_the_in_memory_runs_checkpoint_bit_for_bit(tmp_path, recipe):
    source = _save(tmp_path / "model")
    outputs = {}
    for weights in ("memory", "stream"):
        out = tmp_path / f"out-{weights}"
        model = layerwise.compress(str(source), recipe, dataset=_samples(), output_dir=out, show_progress=False, options=layerwise.CompressOptions.of(weights=weights), device="cpu")
        assert model.layerwise_report.weights.startswith(weights)
        outputs[weights] = out
    memory, streamed = _saved(outputs["memory"]), _saved(outputs["stream"])
    assert sorted(memory) == sorted(streamed)
    assert [k for k in memory if not torch.equal(memory[k], streamed[k])] == []
    config = [json.loads((outputs[w] / "config.json").read_text()) for w in ("memory", "stream")]
    assert config[0] == config[1]
    summaries = [json.loads((outputs[w] / "layerwise_summary.json").read_text()) for w in ("memory", "stream")]
    assert summaries[0]["bytes_before"] == summaries[1]["bytes_before"]  # placeholders counted as the weights
    # the parts written piece by piece were gathered into one shard (a small model), which transformers loads
    assert (outputs["stream"] / "model.safetensors").is_file() and not list(outputs["stream"].glob("part-*"))
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(outputs["stream"])
    ids = _samples(1)[0]["input_ids"]
    reference = AutoModelForCausalLM.from_pretrained(outputs["memory"])
    assert torch.equal(reloaded(ids).logits, reference(ids).logits)


def test_only_one_piece_is_loaded_at_a_time_and_nothing_stays_loaded(tmp_path, monkeypatch):
    source = _save(tmp_path / "model", tie=False, shard=None)
    loaded_at_each_read: list[int] = []
    original = WeightStream.load

    def counting_load(self, tensor, device):
        loaded_at_each_read.append(sum(not is_unloaded(p) for p in self.model.parameters()))
        return original(self, tensor, device)

    monkeypatch.setattr(WeightStream, "load", counting_load)
    model = layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=tmp_path / "out", show_progress=False, options=layerwise.CompressOptions.of(weights="stream"), device="cpu")
    total = len(list(model.parameters()))
    # a decoder layer holds 9 of the model's 30 parameters; never more than one layer's (and a neighbour's)
    assert 0 < max(loaded_at_each_read) <= 12 < total
    assert all(is_unloaded(p) for p in model.parameters())  # every piece was written and dropped
    # so the returned model refuses to run (it computed NaN without a word), naming where its weights went
    with pytest.raises(StreamingError, match=r"streamed from disk.*load_compressed\(.*out'\)"):
        model(torch.tensor([[1, 2, 3]]))


def test_rebuilt_buffers_match_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM

    source = _save(tmp_path / "model")
    skeleton, stream = build_streamed_model(source)
    loaded = AutoModelForCausalLM.from_pretrained(source)
    buffers = dict(loaded.named_buffers())
    for name, buffer in skeleton.named_buffers():
        assert torch.equal(buffer, buffers[name]), name
    assert all(is_unloaded(p) for p in skeleton.parameters())
    # tied weights stay one parameter, read from the checkpoint's one copy
    assert skeleton.lm_head.weight is skeleton.model.embed_tokens.weight
    assert stream.keys[id(skeleton.lm_head.weight)] == "model.embed_tokens.weight"
    stream.close()


def test_auto_streams_when_the_model_would_not_fit(tmp_path, monkeypatch):
    from layerwise.runtime import memory_policy

    source = _save(tmp_path / "model")
    monkeypatch.setattr(memory_policy, "available_memory", lambda: 1024)
    model = layerwise.compress(str(source), "W4A16", output_dir=tmp_path / "out", show_progress=False, device="cpu")
    assert model.layerwise_report.weights.startswith("stream (would not fit in memory")
    monkeypatch.setattr(memory_policy, "available_memory", lambda: 2**40)
    model = layerwise.compress(str(source), "W4A16", output_dir=tmp_path / "out2", show_progress=False, device="cpu")
    assert model.layerwise_report.weights == "memory"
    assert model.layerwise_report.peak_rss_bytes > 0


def test_bad_uses_are_named_errors_before_any_work(tmp_path):
    source = _save(tmp_path / "model")
    with pytest.raises(InvalidArgumentError, match="unknown weights 'disk'"):
        layerwise.compress(str(source), "W4A16", options=layerwise.CompressOptions.of(weights="disk"), device="cpu")
    with pytest.raises(StreamingError, match="pass the folder instead"):
        layerwise.compress(build_tiny_llama(), "W4A16", options=layerwise.CompressOptions.of(weights="stream"), device="cpu")
    with pytest.raises(StreamingError, match="pipeline 'basic' needs every weight in memory"):
        layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), show_progress=False, options=layerwise.CompressOptions.of(weights="stream", pipeline="basic"), device="cpu")
    assert not (tmp_path / "out").exists()


def test_a_folder_without_safetensors_is_refused_with_the_fix(tmp_path):
    source = _save(tmp_path / "model", shard=None)
    torch.save(load_file(source / "model.safetensors"), source / "pytorch_model.bin")
    (source / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*reads safetensors only"):
        layerwise.compress(str(source), "W4A16", output_dir=tmp_path / "out", options=layerwise.CompressOptions.of(weights="stream"), device="cpu")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_key_the_model_has_no_place_for_is_named(tmp_path):
    from safetensors.torch import save_file

    source = _save(tmp_path / "model", shard=None)
    tensors = load_file(source / "model.safetensors")
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StreamingError, match=r"no place for: 'model\.extra\.weight'.*weights='memory'"):
        layerwise.compress(str(source), "W4A16", output_dir=tmp_path / "out", options=layerwise.CompressOptions.of(weights="stream"), device="cpu")


def test_a_nan_weight_on_disk_fails_before_calibration(tmp_path):
    from safetensors.torch import save_file

    source = _save(tmp_path / "model", shard=None)
    tensors = load_file(source / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(NonFiniteError, match="up_proj"):
        layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=tmp_path / "out", show_progress=False, options=layerwise.CompressOptions.of(weights="stream"), device="cpu")
    assert not (tmp_path / "out").exists()


PRUNE_50 = "SparseGPTModifier:\n  sparsity: 0.5\n  targets: [Linear]\n  ignore: [lm_head]\n"
PRUNE_24 = "WandaModifier:\n  sparsity: 0.5\n  mask_structure: '2:4'\n  targets: [Linear]\n  ignore: [lm_head]\n"
PRUNE_24_W4A16 = ("- SparseGPTModifier:\n    sparsity: 0.5\n    mask_structure: '2:4'\n    targets: [Linear]\n"
                  "    ignore: [lm_head]\n- GPTQModifier:\n    scheme: W4A16\n    ignore: [lm_head]\n")


@pytest.mark.parametrize("recipe", [PRUNE_50, PRUNE_24, PRUNE_24_W4A16], ids=["unstructured", "2:4", "2:4+W4A16"])
def test_pruned_checkpoints_stream_bit_for_bit_too(tmp_path, recipe):
    """Pruned weights are written dense as their piece ends, the layout kept; the config is written at the end."""
    source = _save(tmp_path / "model")
    for weights in ("memory", "stream"):
        layerwise.compress(str(source), recipe, dataset=_samples(), output_dir=tmp_path / weights, show_progress=False, options=layerwise.CompressOptions.of(weights=weights), device="cpu")
    memory, streamed = _saved(tmp_path / "memory"), _saved(tmp_path / "stream")
    assert sorted(memory) == sorted(streamed)
    assert [k for k in memory if not torch.equal(memory[k], streamed[k])] == []
    config = [json.loads((tmp_path / w / "config.json").read_text()) for w in ("memory", "stream")]
    assert config[0] == config[1]
    reloaded = layerwise.load_compressed(tmp_path / "stream")
    reference = layerwise.load_compressed(tmp_path / "memory")
    ids = _samples(1)[0]["input_ids"]
    assert torch.equal(reloaded(ids).logits, reference(ids).logits)


def test_shards_are_gathered_to_the_size_asked(tmp_path):
    from layerwise.model_io.streaming.shards import ShardWriter

    writer = ShardWriter(tmp_path)
    for i in range(5):
        writer.write({f"t{i}": torch.full((256,), float(i))})  # 1 KiB each
    names = writer.finish(max_shard_bytes=2500)
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"t0": names[0], "t1": names[0], "t2": names[1], "t3": names[1], "t4": names[2]}
    assert not list(tmp_path.glob("part-*"))
    loaded = _saved(tmp_path)
    assert all(torch.equal(loaded[f"t{i}"], torch.full((256,), float(i))) for i in range(5))


def test_cached_activations_go_to_disk_when_they_would_not_fit(tmp_path, monkeypatch):
    from layerwise.runtime import memory_policy

    source = _save(tmp_path / "model")
    monkeypatch.setattr(memory_policy, "available_memory", lambda: 4096)  # bytes: nothing fits
    model = layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=tmp_path / "out", show_progress=False, options=layerwise.CompressOptions.of(weights="memory"), device="cpu")
    assert model.layerwise_report.activations.startswith("disk (auto: ~")
    monkeypatch.setattr(memory_policy, "available_memory", lambda: 2**40)
    model = layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=tmp_path / "out2", show_progress=False, options=layerwise.CompressOptions.of(weights="memory"), device="cpu")
    assert model.layerwise_report.activations == "cpu"
    with pytest.raises(InvalidArgumentError, match="unknown offload 'ram'"):
        layerwise.compress(str(source), "W4A16", options=layerwise.CompressOptions.of(offload="ram"), device="cpu")


def test_a_truncated_shard_is_named_before_any_work(tmp_path):
    import os

    source = _save(tmp_path / "model")
    shard = sorted(source.glob("model-*.safetensors"))[1]
    os.truncate(shard, shard.stat().st_size - 100)  # an interrupted download
    with pytest.raises(CheckpointError, match=rf"'{shard.name}' is truncated or corrupt.*download it again"):
        layerwise.compress(str(source), "W4A16", output_dir=tmp_path / "out", options=layerwise.CompressOptions.of(weights="stream"), device="cpu")
    assert not (tmp_path / "out").exists()


def test_a_streamed_dry_run_writes_nothing_and_still_reports(tmp_path):
    source = _save(tmp_path / "model")
    before = sorted(p.name for p in tmp_path.iterdir())
    model = layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), show_progress=False, options=layerwise.CompressOptions.of(weights="stream"), device="cpu")
    report = model.layerwise_report
    assert report.weights.startswith("stream") and len(report.compressed_modules) == 21
    assert 0 < report.bytes_after < report.bytes_before
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    with pytest.raises(StreamingError, match="were not kept"):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("recipe", ["NVFP4A16", "GPTQ_MXFP4A16", "NVFP4"])
def test_low_bit_float_checkpoints_stream_bit_for_bit_too(tmp_path, recipe):
    source = _save(tmp_path / "model")
    outputs = {}
    for weights in ("memory", "stream"):
        outputs[weights] = tmp_path / f"out-{weights}"
        layerwise.compress(str(source), recipe, dataset=_samples(), output_dir=outputs[weights], show_progress=False,
                           options=layerwise.CompressOptions.of(weights=weights), device="cpu")
    memory, streamed = _saved(outputs["memory"]), _saved(outputs["stream"])
    assert sorted(memory) == sorted(streamed) and any(k.endswith("weight_packed") for k in memory)
    assert [k for k in memory if not torch.equal(memory[k].view(torch.uint8), streamed[k].view(torch.uint8))] == []
    config = [json.loads((outputs[w] / "config.json").read_text()) for w in ("memory", "stream")]
    assert config[0] == config[1]


def _disk_full_after(writes: int, monkeypatch) -> None:
    """``os.pwrite`` of the part files fails as a full disk does (no file named) after ``writes`` calls."""
    import errno

    from layerwise.model_io.streaming import safetensors_io

    real, calls = safetensors_io.os.pwrite, []

    def pwrite(fd, data, offset):
        calls.append(1)
        if len(calls) > writes:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(safetensors_io.os, "pwrite", pwrite)


@pytest.mark.parametrize("writes", [0, 3], ids=["first piece", "later piece"])
def test_a_full_disk_while_pieces_are_written_names_the_output_and_leaves_no_output(tmp_path, monkeypatch, writes):
    from layerwise.model_io.resume import has_checkpoint
    from layerwise.model_io.saving import OutputNotWritableError

    source, out = _save(tmp_path / "model"), tmp_path / "out"
    _disk_full_after(writes, monkeypatch)
    with pytest.raises(OutputNotWritableError) as info:
        layerwise.compress(str(source), "GPTQ_W4A16", dataset=_samples(), output_dir=out, show_progress=False,
                           options=layerwise.CompressOptions.of(weights="stream"), device="cpu")
    message = str(info.value)
    assert f"'{out}'" in message and "the disk is full (No space left on device)" in message
    assert "while writing 'part-0000" in message and "bytes)" in message
    assert "free space on that disk" in message and "--output-dir" in message
    assert not out.exists()  # written completely or not at all
    # all that stays is a hidden folder holding the finished pieces' checkpoint, for --resume
    left = [p for p in tmp_path.iterdir() if p.name != "model"]
    assert all(p.name.startswith(".out.incomplete-") and has_checkpoint(p) for p in left)
    assert bool(left) == bool(writes)
