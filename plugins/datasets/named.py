"""Calibration datasets by the names llm-compressor gives them (``open_platypus``, ``ultrachat_200k``, ...).

``dataset="open_platypus"`` (CLI ``--dataset open_platypus``; ``"open_platypus:train[:512]"`` picks
another split) reads the dataset through the Hugging Face ``datasets`` package, an optional extra
(``pip install 'layerwise[datasets]'``), from its local cache first: with ``HF_HUB_OFFLINE=1`` /
``HF_DATASETS_OFFLINE=1`` nothing is downloaded, and a dataset not in the cache is an error saying
how to fetch it once. Each name maps to a hub path, a config, a split and what a row becomes
(:data:`NAMED_DATASETS`): a text built from its columns as llm-compressor builds it, or a chat row
(``messages``) that the tokenizer's chat template renders (:mod:`layerwise.model_io.calibration_data`).
Rows are turned into text as they are read, so a 200,000-row set costs the rows calibration uses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from layerwise.plugin import DatasetError
from layerwise.plugin.data import DatasetLoader

_ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n### Instruction:\n"
                 "{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
_ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
           "request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
_EVOL = ("Below is an instruction that describes a programming task. Write a program that appropriately "
         "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def _platypus(row: Mapping[str, Any]) -> str:
    prompt = (_ALPACA_INPUT if row.get("input") else _ALPACA).format(**row)
    return prompt + str(row.get("output") or "")


def _gsm8k(row: Mapping[str, Any]) -> str:
    return f"Question: {row['question']}\nAnswer: {row['answer']}"


def _evol(row: Mapping[str, Any]) -> str:
    return _EVOL.format(**row) + str(row.get("output") or "")


def _cnn(row: Mapping[str, Any]) -> str:
    return f"Article:\n{row['article']}\n\n### Summarization:\n{row['highlights']}\n"


@dataclass(frozen=True)
class NamedDataset:
    """Where one named dataset lives on the hub and what each row becomes."""

    #: the hub path (``load_dataset(path, ...)``)
    path: str
    #: the split read unless the name says another (``name:split``)
    split: str
    #: the columns a row must have (named in the error when one is missing)
    columns: tuple[str, ...]
    #: row -> text; ``None``: the row's ``messages`` (a chat row) or its single column as it is
    render: Callable[[Mapping[str, Any]], str] | None = None
    #: the dataset's config (``load_dataset(path, config)``)
    config: str | None = None

    @property
    def chat(self) -> bool:
        return self.render is None and self.columns == ("messages",)

    def describe(self, split: str) -> str:
        config = f", config {self.config!r}" if self.config else ""
        return f"{self.path}{config}, split {split!r}, column(s) {', '.join(map(repr, self.columns))}"


#: llm-compressor's dataset names -> where they live and what a row becomes (its templates)
NAMED_DATASETS: dict[str, NamedDataset] = {
    "open_platypus": NamedDataset("garage-bAInd/Open-Platypus", "train", ("instruction", "output"), _platypus),
    "ultrachat_200k": NamedDataset("HuggingFaceH4/ultrachat_200k", "train_sft", ("messages",)),
    "gsm8k": NamedDataset("openai/gsm8k", "train", ("question", "answer"), _gsm8k, config="main"),
    "evolcodealpaca": NamedDataset("theblackcat102/evol-codealpaca-v1", "train", ("instruction", "output"), _evol),
    "cnn_dailymail": NamedDataset("abisee/cnn_dailymail", "train", ("article", "highlights"), _cnn, config="3.0.0"),
    "wikitext": NamedDataset("Salesforce/wikitext", "train", ("text",), config="wikitext-2-raw-v1"),
    "pile-eval": NamedDataset("mit-han-lab/pile-val-backup", "validation", ("text",)),
}


def split_name(source: Any) -> tuple[str, str | None] | None:
    """``("open_platypus", None)`` / ``("open_platypus", "train[:512]")`` for a named dataset, else ``None``."""
    if not isinstance(source, str):
        return None
    name, _, split = source.strip().partition(":")
    return (name, split or None) if name in NAMED_DATASETS else None


def load_named(source: str) -> Sequence[Any]:
    """The rows of a named dataset, each turned into text (or a chat row) when it is read."""
    name, split = split_name(source)  # type: ignore[misc]
    spec = NAMED_DATASETS[name]
    split = split or spec.split
    try:
        import datasets
    except ImportError:
        raise DatasetError(f"dataset {name!r} ({spec.describe(split)}) is read with the Hugging Face datasets "
                           f"package, which is not installed: pip install 'layerwise[datasets]' (or pass a .txt / "
                           f".jsonl file)") from None
    try:
        table = datasets.load_dataset(spec.path, spec.config, split=split)
    except ValueError as exc:
        if "split" not in str(exc).lower():
            raise DatasetError(f"dataset {name!r} ({spec.describe(split)}) cannot be read: {exc}") from None
        raise DatasetError(f"dataset {name!r} has no split {split!r} ({exc}); its default is {spec.split!r}: "
                           f"pass {name!r} or '{name}:<split>'") from None
    except (ConnectionError, FileNotFoundError, OSError) as exc:
        where = datasets.config.HF_DATASETS_CACHE
        raise DatasetError(
            f"dataset {name!r} ({spec.describe(split)}) is not in the local datasets cache ({where}) and the hub "
            f"could not be reached ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Fetch it "
            f"once where the hub is reachable: python -c \"import datasets; datasets.load_dataset({spec.path!r}"
            f"{', ' + repr(spec.config) if spec.config else ''}, split={split!r})\" (HF_HUB_OFFLINE=1 then reads "
            f"the cache), or pass a .txt / .jsonl file") from None
    missing = [c for c in spec.columns if c not in table.column_names]
    if missing:
        raise DatasetError(f"dataset {name!r} ({spec.describe(split)}): split {split!r} has no column(s) "
                           f"{', '.join(map(repr, missing))}; it has {', '.join(map(repr, table.column_names))}")
    return _Rows(table, spec)


class _Rows(Sequence):
    """A dataset's rows as texts or chat rows, converted one at a time as they are read."""

    def __init__(self, table: Any, spec: NamedDataset) -> None:
        self._table, self._spec = table, spec

    def __len__(self) -> int:
        return len(self._table)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        row = self._table[index]
        if self._spec.chat:
            return {"messages": row["messages"]}
        if self._spec.render is None:
            return str(row[self._spec.columns[0]])
        return self._spec.render(row)


#: registered with the built-in loaders (plugins/datasets/__init__.py)
NAMED_LOADER = DatasetLoader("dataset-name", lambda source: split_name(source) is not None, load_named, priority=5)
