"""Held-out text for evaluation: read once, hashed, and cut into the same token windows every time.

The windows follow the perplexity protocol of ``bench/gptq_bench.py``, so both measure the same
thing: the text's documents (a file's blank-line separated blocks, exactly as written; a file
without blank lines holds one document per line) are tokenized without special tokens, each
followed by the end-of-sequence token, and concatenated; windows of ``length`` tokens start every
``stride`` tokens, and a last window shorter than ``length`` is dropped. Within a window every
token but the first is scored (predicted from the tokens before it in the window); with a
``stride`` below ``length`` a later window scores only the tokens no earlier window scored, each
with ``length - stride`` or more tokens of context.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layerwise.errors import DatasetError, InvalidArgumentError, require_positive

#: the texts a file holds are split at blank lines, as calibration text files are
DOCUMENT_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class EvalText:
    """The evaluation texts, where they came from and their fingerprint."""

    texts: tuple[str, ...]
    #: sha256 of the file's bytes, or of texts given in memory joined by blank lines
    sha256: str
    #: ``eval.txt (435,749 bytes)`` or ``240 texts given in memory``
    description: str


@dataclass(frozen=True)
class TokenWindows:
    """Fixed-length token windows and which of their positions are scored."""

    #: ``[windows, length]`` token ids
    ids: torch.Tensor
    #: per window, the first position whose token is scored (its prediction comes from the one before)
    first_scored: tuple[int, ...]
    length: int
    stride: int

    @property
    def scored_tokens(self) -> int:
        return sum(self.length - first for first in self.first_scored)


def read_eval_text(source: str | os.PathLike | Sequence[str] | EvalText) -> EvalText:
    """The texts of a ``.txt`` / ``.jsonl`` file (``{"text": ...}`` records) or a list of strings."""
    if isinstance(source, EvalText):
        return source
    if isinstance(source, (str, os.PathLike)):
        return _read_file(Path(source).expanduser())
    texts = tuple(source)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise DatasetError("evaluation texts must be a non-empty list of strings, or a .txt / .jsonl file")
    digest = hashlib.sha256(DOCUMENT_SEPARATOR.join(texts).encode("utf-8")).hexdigest()
    return EvalText(texts, digest, f"{len(texts)} texts given in memory")


def _read_file(path: Path) -> EvalText:
    if not path.is_file():
        raise DatasetError(f"evaluation file '{path}' does not exist; pass a .txt file (documents separated by "
                           f"blank lines) or a .jsonl file of {{\"text\": ...}} records")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"evaluation file '{path}' is not UTF-8 text (byte {exc.start}): re-encode it "
                           f"(iconv -t UTF-8)") from None
    if path.suffix.lower() in (".jsonl", ".json"):
        texts = _jsonl_texts(text, path)
    else:
        texts = [block for block in text.split(DOCUMENT_SEPARATOR) if block.strip()]
        if len(texts) <= 1:
            texts = [line for line in text.splitlines() if line.strip()]
    if not texts:
        raise DatasetError(f"evaluation file '{path}' holds no text")
    return EvalText(tuple(texts), hashlib.sha256(data).hexdigest(), f"{path.name} ({len(data):,} bytes)")


def _jsonl_texts(text: str, path: Path) -> list[str]:
    texts = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number} is not valid JSON: {exc}") from None
        value = record.get("text") if isinstance(record, dict) else record
        if not isinstance(value, str):
            raise DatasetError(f"{path}:{number} has no 'text' string; evaluation reads {{\"text\": ...}} records")
        texts.append(value)
    return texts


def token_windows(texts: Sequence[str], tokenizer: Any, length: int, stride: int | None = None,
                  max_windows: int | None = None) -> TokenWindows:
    """The windows of ``length`` tokens every ``stride`` (default ``length``), at most ``max_windows``."""
    require_positive(length, "window_length", "--window-length")
    stride = length if stride is None else require_positive(stride, "stride", "--stride")
    if stride > length:
        raise InvalidArgumentError(f"stride {stride} is longer than the window ({length} tokens): tokens between "
                                   f"windows would never be scored; pass a stride <= --window-length")
    if max_windows is not None:
        require_positive(max_windows, "max_windows", "--max-windows")
    if tokenizer is None:
        raise DatasetError("evaluating on text needs the model's tokenizer; pass tokenizer= (the compressed "
                           "folder's own is used when it has one)")
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    needed = None if max_windows is None else (max_windows - 1) * stride + length
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + separator)
        if needed is not None and len(ids) >= needed:
            break
    starts = list(range(0, len(ids) - length + 1, stride))[:max_windows]
    if not starts:
        raise DatasetError(f"the evaluation text holds {len(ids)} tokens, fewer than one window of {length}: "
                           f"give more text or a shorter --window-length")
    first = tuple(1 if k == 0 else max(1, length - stride) for k in range(len(starts)))
    return TokenWindows(torch.tensor([ids[s:s + length] for s in starts]), first, length, stride)


#: config fields that hold a model's context length, by family
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
#: windows are at most this long unless asked for
DEFAULT_WINDOW = 2048


def default_window_length(model: torch.nn.Module) -> int:
    """2048 tokens, or the model's context length when shorter."""
    context = context_length(model)
    return min(DEFAULT_WINDOW, context) if context is not None else DEFAULT_WINDOW


def context_length(model: torch.nn.Module) -> int | None:
    """The longest input the model's config says it takes (``max_position_embeddings`` or kin), if it says."""
    config = getattr(model, "config", None)
    for part in (config, getattr(config, "text_config", None)):
        for name in _CONTEXT_FIELDS:
            value = getattr(part, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
