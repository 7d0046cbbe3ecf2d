"""The report card's measurements: identities, monotone in the bit width, the same either way they run."""

from __future__ import annotations

import math
import random

import pytest
import torch

import layerwise
from layerwise.errors import DatasetError, InvalidArgumentError
from layerwise.reports.eval_text import read_eval_text, token_windows
from layerwise.reports.quality import (
    ONE_AT_A_TIME,
    SIDE_BY_SIDE,
    QualityReport,
    evaluate,
    model_kind,
)
from layerwise.reports.token_agreement import TokenAgreement, quantile
from tests.conftest import build_tiny_llama, make_word_tokenizer

#: round-to-nearest at 8, 4 and 3 bits; groups of 32 divide the tiny model's widths (64, 128)
SCHEMES = {
    "W8A16": "W8A16",
    "W4A16": {"QuantizationModifier": {"scheme": "W4A16", "group_size": 32, "ignore": ["lm_head"]}},
    "W3A16": {"QuantizationModifier": {"scheme": "W4A16", "num_bits": 3, "group_size": 32, "ignore": ["lm_head"]}},
}


def word_texts(count: int = 40, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(f"w{rng.randrange(126)}" for _ in range(rng.randrange(20, 80))) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizer():
    return make_word_tokenizer(128)


@pytest.fixture(scope="module")
def compressed_copies():
    return {name: layerwise.compress(build_tiny_llama(), recipe, show_progress=False)
            for name, recipe in SCHEMES.items()}


def test_a_model_against_itself_loses_nothing(tokenizer):
    model = build_tiny_llama()
    report = evaluate(model, model, word_texts(), tokenizer, window_length=32, max_windows=16, show_progress=False)
    tokens = report.tokens
    assert (tokens.kl_mean, tokens.kl_median, tokens.kl_p99, tokens.kl_max) == (0.0, 0.0, 0.0, 0.0)
    assert tokens.top1_agreement == 1.0 and tokens.top5_agreement == 1.0
    assert tokens.perplexity_original == tokens.perplexity_compressed
    assert set(tokens.kl_per_window) == {0.0} and report.kind == "causal-lm"


def test_kl_grows_as_the_bits_shrink(tokenizer, compressed_copies):
    original = build_tiny_llama()
    reports = {name: evaluate(original, model, word_texts(), tokenizer, window_length=32, max_windows=20,
                              show_progress=False)
               for name, model in compressed_copies.items()}
    kl = {name: r.tokens.kl_mean for name, r in reports.items()}
    assert 0 < kl["W8A16"] < kl["W4A16"] < kl["W3A16"], kl
    top1 = {name: r.tokens.top1_agreement for name, r in reports.items()}
    assert top1["W8A16"] > top1["W4A16"] > top1["W3A16"], top1


def test_one_at_a_time_gives_the_same_numbers_as_side_by_side(tokenizer, compressed_copies):
    original, compressed = build_tiny_llama(), compressed_copies["W4A16"]
    texts = word_texts()
    options = dict(window_length=32, max_windows=12, show_progress=False, device="cpu")  # both fit in RAM
    together = evaluate(original, compressed, texts, tokenizer, **options)
    apart = evaluate(lambda: original, lambda: compressed, texts, tokenizer, **options)
    batched = evaluate(original, compressed, texts, tokenizer, batch_size=4, together=False, **options)
    assert together.placement == SIDE_BY_SIDE and apart.placement == batched.placement == ONE_AT_A_TIME
    assert apart.tokens == together.tokens
    assert batched.tokens.kl_mean == pytest.approx(together.tokens.kl_mean, rel=1e-4)
    assert batched.tokens.perplexity_compressed == pytest.approx(together.tokens.perplexity_compressed, rel=1e-5)


def test_perplexity_is_the_gptq_bench_protocol(tokenizer):
    """Non-overlapping windows, every token but each window's first scored: bench/gptq_bench.py's perplexity."""
    model, texts = build_tiny_llama(), word_texts()
    report = evaluate(model, model, texts, tokenizer, window_length=32, max_windows=10, show_progress=False)
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    total = 0.0
    with torch.no_grad():
        for start in range(0, 10 * 32, 32):
            window = torch.tensor([ids[start:start + 32]])
            logits = model(input_ids=window).logits[0, :-1].float()
            total += torch.nn.functional.cross_entropy(logits, window[0, 1:], reduction="sum").item()
    assert report.tokens.tokens == 10 * 31 and report.data["windows"] == 10
    assert report.tokens.perplexity_original == pytest.approx(math.exp(total / (10 * 31)), rel=1e-6)


def test_overlapping_windows_score_each_token_once(tokenizer):
    windows = token_windows(word_texts(), tokenizer, length=32, stride=8, max_windows=5)
    assert windows.first_scored == (1, 24, 24, 24, 24)
    assert windows.scored_tokens == 31 + 4 * 8
    assert torch.equal(windows.ids[1, :24], windows.ids[0, 8:])


def test_the_text_is_hashed_and_read_as_written(tmp_path):
    path = tmp_path / "eval.txt"
    path.write_text("first block\n    indented line\n\nsecond block\n")
    text = read_eval_text(path)
    assert text.texts == ("first block\n    indented line", "second block\n")  # kept exactly, as gptq_bench does
    assert len(text.sha256) == 64 and text.description == f"eval.txt ({path.stat().st_size} bytes)"
    (tmp_path / "lines.txt").write_text("one\ntwo\nthree\n")
    assert read_eval_text(tmp_path / "lines.txt").texts == ("one", "two", "three")
    (tmp_path / "e.jsonl").write_text('{"text": "a b"}\n{"text": "c"}\n')
    assert read_eval_text(tmp_path / "e.jsonl").texts == ("a b", "c")


def test_bad_text_and_windows_are_named_errors(tmp_path, tokenizer):
    with pytest.raises(DatasetError, match="does not exist"):
        read_eval_text(tmp_path / "missing.txt")
    with pytest.raises(DatasetError, match="fewer than one window"):
        token_windows(["w1 w2 w3"], tokenizer, length=32)
    with pytest.raises(InvalidArgumentError, match="stride 40 is longer than the window"):
        token_windows(word_texts(), tokenizer, length=32, stride=40)


def test_quantiles_and_position_means():
    assert quantile(torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0]), 0.5) == 2.0
    assert quantile(torch.arange(101, dtype=torch.float64), 0.99) == pytest.approx(99.0)
    agreement = TokenAgreement(length=4)
    reference = torch.log_softmax(torch.tensor([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 2.0]]), -1)
    agreement.add(reference, reference.flip(-1), torch.tensor([0, 1, 2]), first=1)
    metrics = agreement.result()
    assert metrics.kl_per_position[0] == 0.0 and metrics.kl_per_position[2] == 0.0  # the middle row is symmetric
    assert metrics.kl_per_position[1] > 0 and metrics.top1_agreement == pytest.approx(1 / 3)


def test_the_report_round_trips_through_a_dict(tokenizer, compressed_copies):
    report = evaluate(build_tiny_llama(), compressed_copies["W8A16"], word_texts(), tokenizer, window_length=32,
                      max_windows=4, show_progress=False, names=("a", "b"))
    document = report.to_dict()
    assert QualityReport.from_dict({**document, "from_a_newer_layerwise": 1}) == report
    assert document["original"] == "a" and document["data"]["sha256"] == read_eval_text(word_texts()).sha256


def test_an_encoder_is_compared_by_its_embeddings():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128)
    original = BertModel(config).eval()
    tokenizer = make_word_tokenizer(128)
    texts = word_texts(12)
    assert model_kind(original) == "encoder"
    same = evaluate(original, original, texts, tokenizer, show_progress=False)
    assert same.tokens is None and same.embeddings.mean_cosine == pytest.approx(1.0)
    assert same.embeddings.nearest_neighbour_agreement == 1.0 and same.data["texts"] == 12
    from layerwise.reports.embedding_eval import embedding_agreement, sentence_embeddings

    compressed = _perturbed(original)
    report = evaluate(original, compressed, texts, tokenizer, show_progress=False)
    direct = embedding_agreement(sentence_embeddings(original, tokenizer, texts),
                                 sentence_embeddings(compressed, tokenizer, texts))
    assert report.embeddings == direct and report.embeddings.mean_cosine < 1.0


def test_a_seq2seq_model_gets_both():
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    config = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                      decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    original = T5ForConditionalGeneration(config).eval()
    tokenizer = make_word_tokenizer(128)
    assert model_kind(original) == "seq2seq"
    same = evaluate(original, original, word_texts(12), tokenizer, window_length=16, show_progress=False)
    assert same.tokens.kl_max == 0.0 and same.tokens.top1_agreement == 1.0
    assert same.tokens.tokens == same.data["windows"] * 8  # the second half of every window
    assert same.embeddings.mean_cosine == pytest.approx(1.0)
    moved = evaluate(original, _perturbed(original), word_texts(12), tokenizer, window_length=16,
                     show_progress=False)
    assert moved.tokens.kl_mean > 0 and moved.embeddings.mean_cosine < 1.0
    with pytest.raises(InvalidArgumentError, match="may not overlap"):
        evaluate(original, original, word_texts(12), tokenizer, window_length=16, stride=4, show_progress=False)


def test_models_of_different_kinds_are_refused(tokenizer):
    from transformers import LlamaModel

    with pytest.raises(InvalidArgumentError, match="compare a model with its own compressed copy"):
        evaluate(build_tiny_llama(), LlamaModel(build_tiny_llama().config).eval(), word_texts(), tokenizer,
                 window_length=32, max_windows=2, show_progress=False)


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """A copy with every Linear weight rounded to a coarse grid: a stand-in for a compressed model."""
    import copy

    copied = copy.deepcopy(model)
    with torch.no_grad():
        for module in copied.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_((module.weight * 8).round() / 8)
    return copied
