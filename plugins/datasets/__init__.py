"""Built-in calibration-data loaders: strings, text/JSONL files (text or chat rows), datasets.Dataset,
tokenized samples, and datasets by llm-compressor's names (:mod:`.named`, through the optional ``datasets``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from layerwise import hookimpl
from layerwise.plugin import DatasetError
from layerwise.plugin.data import MODEL_INPUT_KEYS, TEXT_KEYS, DatasetLoader

from .named import NAMED_LOADER


def _is_path(source: Any, suffixes: tuple[str, ...]) -> bool:
    return isinstance(source, (str, Path)) and str(source).lower().endswith(suffixes)


def _read_utf8(path: Path) -> str:
    """The file's text; a missing, unreadable or non-UTF-8 file is a DatasetError naming it."""
    if not path.is_file():
        raise DatasetError(f"calibration file {str(path)!r} does not exist")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(
            f"calibration file {str(path)!r} is not UTF-8 text: byte 0x{exc.object[exc.start]:02x} at offset "
            f"{exc.start} cannot be decoded ({exc.reason}). Calibration data must be UTF-8 text: a .txt file "
            f"(one document per paragraph or line) or a .jsonl file of {{\"text\": ...}} records; re-encode it "
            f"(iconv -f <its encoding> -t UTF-8) or extract the text of a binary file first") from exc
    except OSError as exc:
        raise DatasetError(f"cannot read calibration file {str(path)!r}: {exc.strerror or exc}") from exc


def _read_text_file(source: Any) -> list[str]:
    text = _read_utf8(Path(source))
    blocks = [b.strip() for b in text.split("\n\n")]
    blocks = [b for b in blocks if b]
    # a file of one-liners has no blank lines: each line is then a document
    if len(blocks) <= 1:
        blocks = [line.strip() for line in text.splitlines() if line.strip()]
    return blocks


def _read_jsonl(source: Any) -> list[str] | list[Mapping[str, Any]]:
    path = Path(source)
    records = []
    for number, line in enumerate(_read_utf8(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}:{number} is not valid JSON: {exc}") from None
    return _texts_or_samples(records, str(path))


def _texts_or_samples(records: list[Any], where: str) -> list[str] | list[Mapping[str, Any]]:
    if not records:
        return []
    first = records[0]
    if isinstance(first, str):
        return records
    if isinstance(first, Mapping) and _is_model_input(first):
        return records
    if isinstance(first, Mapping) and "messages" in first:  # chat rows: rendered with the chat template later
        return [{"messages": r.get("messages")} if isinstance(r, Mapping) else r for r in records]
    if isinstance(first, Mapping) and "text" in first:
        return [r["text"] for r in records]
    raise DatasetError(f"records in {where} need a 'text' field, chat 'messages' or model inputs "
                       f"({', '.join(MODEL_INPUT_KEYS)}); the first has "
                       f"{sorted(first) if isinstance(first, Mapping) else type(first).__name__}")


def _is_model_input(record: Mapping[str, Any]) -> bool:
    """Token ids, or what an image / audio tower reads: passed to the model as they are."""
    return any(key in record for key in MODEL_INPUT_KEYS)


def _is_tokenized(source: Any) -> bool:
    if isinstance(source, Mapping):
        return _is_model_input(source)
    return isinstance(source, (list, tuple)) and bool(source) and isinstance(source[0], Mapping)


def _load_tokenized(source: Any) -> list[Mapping[str, Any]]:
    if isinstance(source, Mapping):  # one dict of batched tensors: split into samples
        if "input_ids" not in source or set(source) - set(TEXT_KEYS):
            return [source]  # image / audio inputs: one model-ready batch, passed whole
        ids = source["input_ids"]
        count = len(ids) if getattr(ids, "dim", lambda: 2)() > 1 else 1
        if count == 1:
            return [source]
        return [{k: v[i] for k, v in source.items()} for i in range(count)]
    return _texts_or_samples(list(source), "the sample list")


def _is_hf_dataset(source: Any) -> bool:
    return hasattr(source, "column_names") and hasattr(source, "__getitem__")


def _load_hf_dataset(source: Any) -> list[str] | list[Mapping[str, Any]]:
    columns = source.column_names
    if "input_ids" in columns:
        return [dict(row) for row in source]
    if "messages" in columns:
        return [{"messages": row["messages"]} for row in source]
    if "text" in columns:
        return list(source["text"])
    raise DatasetError(f"the datasets.Dataset needs a 'text', 'messages' or 'input_ids' column; it has {columns}")


LOADERS = (
    DatasetLoader("tokenized", _is_tokenized, _load_tokenized, priority=30),
    DatasetLoader("texts", lambda s: isinstance(s, (list, tuple)) and all(isinstance(t, str) for t in s),
                  lambda s: [t for t in s if t.strip()], priority=20),
    DatasetLoader("hf-dataset", _is_hf_dataset, _load_hf_dataset, priority=10),
    DatasetLoader("jsonl-file", lambda s: _is_path(s, (".jsonl", ".json")), _read_jsonl),
    DatasetLoader("text-file", lambda s: _is_path(s, (".txt", ".md", ".text")), _read_text_file),
    NAMED_LOADER,
)


@hookimpl
def layerwise_register_datasets(register):
    for loader in LOADERS:
        register(loader.name, loader)
