"""Calibration data: from whatever the user has to a list of model-ready batches.

Sources are recognised by the dataset loaders registered through
``layerwise_register_datasets`` (built-ins: lists of strings, text and JSONL files,
``datasets.Dataset``, already tokenized samples). Text is tokenized with the
model's tokenizer and either cut into windows of ``max_seq_length`` tokens
(``packing="chunk"``, the usual choice for causal LMs) or one sample per document,
truncated (``packing="truncate"``, right for encoders whose inputs carry [CLS]/[SEP]).

Chat rows (``{"messages": [{"role": ..., "content": ...}, ...]}``, as llm-compressor's chat datasets
hold them) are rendered to text with the tokenizer's chat template first (``chat_template="auto"``,
the default; ``"on"`` requires every row to be one, ``"off"`` joins the contents as plain text), one
row at a time as the tokens are needed: a 200,000-conversation set renders the few it uses.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from layerwise.common.user_warnings import warn_user
from layerwise.errors import DatasetError, require_positive
from layerwise.host.plugin_manager import registry

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class DatasetLoader:
    """Recognises one kind of data source and turns it into texts or tokenized samples."""

    name: str
    accepts: Callable[[Any], bool]
    load: Callable[[Any], list[str] | list[Mapping[str, Any]]]
    #: higher runs first when several loaders accept a source
    priority: int = 0


def _describe(source: Any) -> str:
    text = repr(source)
    return text if len(text) < 80 else text[:77] + "..."


def load_records(source: Any) -> list[str] | list[Mapping[str, Any]]:
    """Texts or tokenized samples from ``source``, by the first registered loader that accepts it."""
    loaders = sorted((loader for _, loader in registry("datasets").items()), key=lambda l: -l.priority)
    for loader in loaders:
        if loader.accepts(source):
            records = loader.load(source)
            if not records:
                raise DatasetError(f"the calibration dataset {_describe(source)} is empty "
                                   f"(read by the {loader.name!r} loader); give it some text or samples")
            return records
    raise DatasetError(
        f"no dataset loader understands {_describe(source)}; pass a list of strings, a .txt/.jsonl file, "
        f"a datasets.Dataset or tokenized samples (loaders: {', '.join(registry('datasets').names())})"
    )


def describe_data(source: Any) -> dict[str, str]:
    """``{"description", "sha256"}`` of calibration data, for the run summary and the model card.

    A file: its name, size and the sha256 of its bytes. Texts or tokenized samples in memory: how many,
    and the sha256 of the texts joined by blank lines (of the token ids for samples). A
    ``datasets.Dataset``: its rows and its own fingerprint. Nothing given: ``{}``.
    """
    if source is None:
        return {}
    if isinstance(source, (str, os.PathLike)) and os.path.isfile(source):
        data = Path(source).read_bytes()
        return {"description": f"{Path(source).name} ({len(data):,} bytes)",
                "sha256": hashlib.sha256(data).hexdigest()}
    if hasattr(source, "column_names") and hasattr(source, "_fingerprint"):
        return {"description": f"a datasets.Dataset of {len(source):,} rows", "sha256": str(source._fingerprint)}
    records = load_records(source)
    digest = hashlib.sha256()
    if isinstance(records[0], str):
        digest.update("\n\n".join(records).encode("utf-8"))
        return {"description": f"{len(records):,} texts given in memory", "sha256": digest.hexdigest()}
    for record in records:
        ids = record.get("input_ids") if isinstance(record, Mapping) else None
        if ids is not None:
            digest.update(torch.as_tensor(ids).to(torch.int64).numpy().tobytes())
    return {"description": f"{len(records):,} tokenized samples given in memory", "sha256": digest.hexdigest()}


def calibration_batches(source: Any, tokenizer: Any = None, num_samples: int = 512,
                        max_seq_length: int = 2048, packing: str | None = None,
                        shuffle: bool = False, seed: int = 0, chat_template: str = "auto") -> list[Batch]:
    """Up to ``num_samples`` batches of one sample each (no padding wasted on calibration)."""
    return batches_from_records(load_records(source), tokenizer, num_samples, max_seq_length, packing,
                                shuffle, seed, source=source, chat_template=chat_template)


def batches_from_records(records: list[str] | list[Mapping[str, Any]], tokenizer: Any = None,
                         num_samples: int = 512, max_seq_length: int = 2048, packing: str | None = None,
                         shuffle: bool = False, seed: int = 0, *, source: Any = None,
                         chat_template: str = "auto") -> list[Batch]:
    """:func:`calibration_batches` for records already read by :func:`load_records`.

    ``compress()`` reads the data before loading the model, so that a bad file is
    reported in a second, not after minutes of loading; ``source`` names it in errors.
    """
    require_positive(num_samples, "num_samples")
    require_positive(max_seq_length, "max_seq_length")
    if is_chat(records[0]):
        texts: Iterable[str] = render_chats(records, tokenizer, chat_template, source)
        samples = _tokenize(texts, tokenizer, num_samples, max_seq_length, packing)
    elif chat_template == "on":
        raise DatasetError(f"chat_template='on' (CLI: --chat-template on) but the calibration dataset "
                           f"{_describe(source)} holds no chat rows ({{\"messages\": [{{\"role\": ..., "
                           f"\"content\": ...}}]}}); give chat rows, or chat_template='auto'")
    elif isinstance(records[0], str):
        samples = _tokenize(records, tokenizer, num_samples, max_seq_length, packing)
    else:
        samples = [_as_batch(r, max_seq_length) for r in records]
    if shuffle:
        random.Random(seed).shuffle(samples)
    samples = [s for s in samples if "input_ids" not in s or s["input_ids"].shape[-1] > 0][:num_samples]
    if not samples:
        raise DatasetError(f"the calibration dataset {_describe(source)} produced no tokens")
    return samples


def is_chat(record: Any) -> bool:
    """A chat row: a mapping with ``messages`` and no model inputs."""
    return isinstance(record, Mapping) and "messages" in record and not any(k in record for k in MODEL_INPUT_KEYS)


def render_chats(records: Iterable[Any], tokenizer: Any, chat_template: str, source: Any = None) -> Iterable[str]:
    """Each chat row as text, lazily: the tokenizer's chat template (``auto`` / ``on``), or the contents (``off``)."""
    if tokenizer is None:
        raise DatasetError("the calibration data is chat rows but the model has no tokenizer; pass tokenizer= "
                           "(one with a chat template) or tokenized samples ({'input_ids': ...})")
    if chat_template != "off" and not getattr(tokenizer, "chat_template", None):
        raise DatasetError(f"the calibration dataset {_describe(source)} holds chat rows (messages) but the "
                           f"tokenizer ({type(tokenizer).__name__}) has no chat template to render them with: pass a "
                           f"tokenizer that has one (in Python tokenizer=, e.g. the instruct model's; on the command line the "
                           f"--model folder's tokenizer is used), set tokenizer.chat_template, "
                           f"or chat_template='off' (CLI: --chat-template off) to calibrate on the messages' contents "
                           f"as plain text")
    for index, record in enumerate(records):
        if not is_chat(record):
            raise DatasetError(f"calibration row {index} of {_describe(source)} is not a chat row like the first "
                               f"(a mapping with 'messages'); give one kind of row")
        messages = _messages(record["messages"], index, source)
        if chat_template == "off":
            yield "\n".join(m["content"] for m in messages if isinstance(m["content"], str))
        else:
            yield tokenizer.apply_chat_template(messages, tokenize=False)


def _messages(messages: Any, index: int, source: Any) -> list[Mapping[str, Any]]:
    if not isinstance(messages, (list, tuple)) or not messages or not all(
            isinstance(m, Mapping) and "role" in m and "content" in m for m in messages):
        raise DatasetError(f"calibration row {index} of {_describe(source)}: 'messages' must be a non-empty list of "
                           f"{{\"role\": ..., \"content\": ...}} mappings, got {_describe(messages)}")
    return list(messages)


def _tokenize(texts: Iterable[str], tokenizer: Any, num_samples: int, max_seq_length: int,
              packing: str | None) -> list[Batch]:
    if tokenizer is None:
        raise DatasetError("the calibration data is text but the model has no tokenizer; pass tokenizer= "
                           "or tokenized samples ({'input_ids': ...})")
    if packing is None:  # encoders frame every input with special tokens; decoders read running text
        packing = "truncate" if getattr(tokenizer, "cls_token", None) else "chunk"
    if packing == "truncate":
        out = []
        for text in itertools.islice(texts, num_samples):
            enc = tokenizer(text, truncation=True, max_length=max_seq_length, return_tensors="pt")
            out.append({k: v for k, v in enc.items()})
        return out
    check_packing(packing)
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        # verbose=False: the windows below cut the ids to length, so the tokenizer need not warn
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"] + separator)
        if len(ids) >= num_samples * max_seq_length:
            break
    windows = [ids[i:i + max_seq_length] for i in range(0, len(ids), max_seq_length)][:num_samples]
    out = []
    for window in windows:
        input_ids = torch.tensor([window])
        out.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)})
    return out


def _as_batch(record: Mapping[str, Any], max_seq_length: int) -> Batch:
    if not any(key in record for key in MODEL_INPUT_KEYS):
        raise DatasetError(f"a tokenized sample needs one of {', '.join(MODEL_INPUT_KEYS)}; "
                           f"got keys {sorted(record)}")
    # image / audio samples are passed through whole: cutting their token ids would cut
    # the image placeholders out of step with the pixel values
    multimodal = any(key not in TEXT_KEYS for key in record)
    batch = {}
    for key, value in record.items():
        tensor = value if isinstance(value, torch.Tensor) else torch.tensor(value)
        if tensor.dim() == 1 and key in TEXT_KEYS:
            tensor = tensor.unsqueeze(0)
        if key in TEXT_KEYS and not multimodal:
            tensor = tensor[..., :max_seq_length]
        batch[key] = tensor
    return batch


#: keys that make a record a model input: text ids, or an image / audio tower's input
MODEL_INPUT_KEYS = ("input_ids", "inputs_embeds", "input_features", "pixel_values")
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "position_ids", "labels")


#: tokens per calibration sample unless the model's context is shorter
DEFAULT_MAX_SEQ_LENGTH = 2048
#: config fields that hold a model's context length, by family
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def default_max_seq_length(model: torch.nn.Module) -> int:
    """2048, or the model's context length when shorter.

    Calibration windows longer than the context would run positions the model never
    learned (and an absolute position table would be indexed out of range).
    """
    context = context_length(model)
    return min(DEFAULT_MAX_SEQ_LENGTH, context) if context is not None else DEFAULT_MAX_SEQ_LENGTH


def context_length(model: torch.nn.Module) -> int | None:
    """The longest input the model was built for (``max_position_embeddings`` & co.), ``None`` if unknown."""
    config = getattr(model, "config", None)
    for part in (config, getattr(config, "text_config", None)):
        for name in _CONTEXT_FIELDS:
            value = getattr(part, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


#: how texts become windows: ``None`` (chosen from the tokenizer), ``chunk`` or ``truncate``
PACKINGS = (None, "chunk", "truncate")


def check_packing(packing: str | None) -> None:
    """``packing`` is one of :data:`PACKINGS`."""
    if packing not in PACKINGS:
        raise DatasetError(f"unknown packing {packing!r}; valid: chunk, truncate")


def check_unread_dataset(source: Any, modifiers: list[Any]) -> None:
    """A dataset given to a recipe that reads none: a missing file is still an error, else a warning says so."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source).expanduser()
        looks_like_file = path.suffix != "" or os.sep in str(source)
        if looks_like_file and not path.exists():
            raise DatasetError(f"calibration file {str(source)!r} does not exist")
    names = ", ".join(type(m).__name__ for m in modifiers)
    warn_user(f"the recipe ({names}) reads no calibration data, so the dataset given is not used; leave it out, or "
              f"choose a calibrated recipe (e.g. GPTQ_W4A16)", CalibrationWarning)


class CalibrationWarning(UserWarning):
    """Calibration data that will run, but not as well as the user probably expects (the message says why)."""


def warn_about_calibration(model: torch.nn.Module, max_seq_length: int | None, samples: int,
                           minimum: tuple[str, int] | None) -> None:
    """Say what is legal but probably a mistake: windows beyond the model's context, too few samples.

    ``minimum`` is (the modifier asking, its sensible minimum of samples), from the recipe.
    """
    context = context_length(model)
    if max_seq_length is not None and context is not None and max_seq_length > context:
        warn_user(f"max_seq_length={max_seq_length} is beyond the model's context of {context} tokens: the "
                  f"positions past {context} were never trained (an absolute position table cannot even index "
                  f"them); use --max-seq-length {context} or less", CalibrationWarning)
    if minimum is not None and 0 < samples < minimum[1]:
        warn_user(f"{samples} calibration sample{'s' if samples != 1 else ''}: {minimum[0]} needs at least "
                  f"{minimum[1]} to estimate its statistics well (each a full window of tokens); pass more "
                  f"text or --num-samples {minimum[1]} or more", CalibrationWarning)
