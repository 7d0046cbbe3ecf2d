"""A tokenizer for tests and benchmarks that run offline: whitespace words ``w0``, ``w1``, ... as ids."""

from __future__ import annotations

from typing import Any


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer whose ids fit ``vocab_size`` (``<unk>`` 0, ``<eos>`` 1, ``w<i>`` i + 2); no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(vocab_size - 2)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
