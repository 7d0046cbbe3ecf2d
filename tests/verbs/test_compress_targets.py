"""``compress()`` and its targets: found by structure when nothing names them; what the user wrote is checked."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers as tf

import layerwise
from layerwise.host.pipeline import PipelineFailed
from layerwise.host.pipeline_selection import PipelineFallbackWarning
from layerwise.tracing.targets import TargetError

#: group size 32 divides every in_features of the tiny models below
GPTQ = "GPTQModifier:\n  scheme: W4A16\n  group_size: 32\n"


def _electra() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.ElectraConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              vocab_size=96, max_position_embeddings=64, embedding_size=32)
    return tf.ElectraModel(config).eval()


def _batches(n: int = 2, vocab: int = 96) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(4, vocab, (1, 12), generator=gen)} for _ in range(n)]


def test_a_model_without_patch_or_no_split_modules_runs_sequentially_without_fallback() -> None:
    model = _electra()
    assert not model._no_split_modules
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layerwise.compress(model, GPTQ, dataset=_batches(), show_progress=False, options=layerwise.CompressOptions.of(patch=False))
    assert not [w for w in caught if issubclass(w.category, PipelineFallbackWarning)]
    report = model.layerwise_report
    assert report.pipeline == "sequential"
    assert report.targets_found == "2 x ElectraLayer (encoder.layer.0-1), found by structure"
    assert report.targets_source == "structure"
    assert len(report.compressed_modules) == 12  # 2 layers x 6 Linear


@pytest.mark.parametrize("argument,typo,close", [
    ("sequential_targets", "ElectraLayr", "ElectraLayer"),
    ("ignore", "encoder.layer.0.intermediate.dens", "encoder.layer.0.intermediate.dense"),
])
def test_a_typo_in_targets_or_ignore_is_an_error_before_anything_runs(tmp_path, argument, typo, close) -> None:
    out = tmp_path / "out"
    with pytest.raises(TargetError, match="did you mean") as info:
        layerwise.compress(_electra(), GPTQ, dataset=_batches(), output_dir=out, show_progress=False, options=layerwise.CompressOptions.of(patch=False, **{argument: [typo]}))
    assert info.value.unmatched == (typo,) and close in info.value.suggestions[typo]
    assert repr(typo) in str(info.value) and repr(close) in str(info.value)
    assert not out.exists()


def test_cli_typo_exits_2_with_the_closest_name_and_writes_nothing(tiny_llama_dir, tmp_path, capsys) -> None:
    from layerwise.cli import main

    out = tmp_path / "out"
    code = main(["compress", "--model", str(tiny_llama_dir), "--targets", "LlamaDecoderLayr",
                 "--output-dir", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    assert "'LlamaDecoderLayr' matches no module" in err and "did you mean 'LlamaDecoderLayer'" in err
    assert "Traceback" not in err and not out.exists()


class _Chainless(torch.nn.Module):
    """Blocks with a norm run between them: not the simple chain ``layer_sequential`` needs."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(96, width)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU())
                                          for _ in range(2))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(width) for _ in range(2))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block, norm in zip(self.blocks, self.norms):
            x = norm(block(x))
        return x


def test_a_named_pipeline_is_never_replaced_by_compress() -> None:
    model = _Chainless().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(PipelineFailed, match="not the output of"):
            layerwise.compress(model, GPTQ, dataset=_batches(), show_progress=False, options=layerwise.CompressOptions.of(pipeline="layer_sequential"))
    assert not [w for w in caught if issubclass(w.category, PipelineFallbackWarning)]
    # without a named pipeline the same model is found by structure and traced
    layerwise.compress(model, GPTQ, dataset=_batches(), show_progress=False)
    assert model.layerwise_report.pipeline == "sequential"
    assert model.layerwise_report.targets_found == "2 x Sequential (blocks.0-1), found by structure"


def test_summary_prints_the_targets_line(capsys) -> None:
    from layerwise.cli.app import _print_summary

    model = _electra()
    layerwise.compress(model, GPTQ, dataset=_batches(), show_progress=False, options=layerwise.CompressOptions.of(patch=False))
    _print_summary(model)
    assert "targets:            2 x ElectraLayer (encoder.layer.0-1), found by structure" in capsys.readouterr().out


def test_real_minilm_held_out_from_the_zoo_compresses_sequentially(minilm_path) -> None:
    """MiniLM as a family layerwise does not know: no patch, no ``_no_split_modules``."""
    from layerwise.model_io.loading import load_model, load_tokenizer
    from layerwise.verbs.demo import demo_sentences

    model = load_model(minilm_path, patch=False)
    model._no_split_modules = []  # on the instance: what a class that declares none looks like
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layerwise.compress(model, "GPTQ_W4A16", dataset=demo_sentences("calibration")[:16], max_seq_length=32, num_calibration_samples=16, show_progress=False, options=layerwise.CompressOptions.of(tokenizer=load_tokenizer(minilm_path), patch=False))
    assert not [w for w in caught if issubclass(w.category, PipelineFallbackWarning)]
    report = model.layerwise_report
    assert report.pipeline == "sequential"
    assert report.targets_found == "6 x BertLayer (encoder.layer.0-5), found by structure"
    assert len(report.compressed_modules) == 37  # 6 layers x 6 Linear, and the pooler: no patch ignores it


class _Swallowed(_Chainless):
    """The blocks run under a condition on tensor values: tracing wraps them (and the targets) away."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block, norm in zip(self.blocks, self.norms):
            if x.sum() > 0:
                x = norm(block(x))
            else:
                x = norm(block(-x))
        return x


def test_targets_the_user_named_never_fall_back_to_the_whole_model() -> None:
    model = _Swallowed().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(PipelineFailed, match="not the output of"):  # layer_sequential's reason, last tried
            layerwise.compress(model, GPTQ, dataset=_batches(), show_progress=False, options=layerwise.CompressOptions.of(sequential_targets=["re:blocks\\.\\d+"]))
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, PipelineFallbackWarning)]
    assert len(fallbacks) == 1 and "falling back to 'layer_sequential'" in fallbacks[0]
    assert not any("'basic'" in message for message in fallbacks)
