"""The report card: an original model and its compressed copy over the same held-out text.

:func:`evaluate` runs both models over the same deterministic windows
(:mod:`layerwise.reports.eval_text`) and compares what they predict:

- a **causal LM**: perplexity of both, the KL divergence of the compressed model's next-token
  distribution from the original's (mean, median, p99, max over tokens, per window and per
  position) and top-1 / top-5 agreement (:mod:`layerwise.reports.token_agreement`);
- an **encoder**: the mean cosine of its sentence embeddings to the original's and nearest-neighbour
  agreement over the texts (:mod:`layerwise.reports.embedding_eval`);
- a **seq2seq** model: both; the encoder reads each window's first half and the decoder, teacher
  forced, predicts the second half.

**Side by side or one at a time.** Side by side, each window runs through both models and is compared
at once: both models are resident. One at a time, the original runs over every window first and its
log-probabilities of the scored tokens wait on disk (a temporary folder: windows x scored tokens x
vocabulary x 4 bytes) while it is released and the compressed model runs. A model may be given as a
module or as a function that loads it (then it is loaded when its turn comes and dropped after).
Either way the numbers are the same. The models run on ``device`` (default: the first GPU, else the
CPU) and return to where they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

import torch

from layerwise.errors import InvalidArgumentError
from layerwise.reports.embedding_eval import (
    EmbeddingAgreement,
    embedding_agreement,
    sentence_embeddings,
)
from layerwise.reports.eval_text import (
    EvalText,
    TokenWindows,
    context_length,
    default_window_length,
    read_eval_text,
    token_windows,
)
from layerwise.reports.token_agreement import TokenAgreement, TokenMetrics, log_probs
from layerwise.runtime.devices import free_memory, resolve_device

#: a loaded model, or a function that loads it when its turn comes
ModelSource = Union[torch.nn.Module, Callable[[], torch.nn.Module]]  # noqa: UP007 - a runtime alias
KINDS = ("causal-lm", "encoder", "seq2seq")
SIDE_BY_SIDE, ONE_AT_A_TIME = "side by side", "one at a time"
#: texts longer than this many tokens are cut before their embeddings are compared
EMBEDDING_MAX_LENGTH = 128


@dataclass(frozen=True)
class QualityReport:
    """What :func:`evaluate` measured; saved as the ``quality`` field of ``layerwise_summary.json``."""

    #: ``causal-lm``, ``encoder`` or ``seq2seq``
    kind: str
    #: the text: ``description``, ``sha256``, and ``windows``, ``window_length``, ``stride``,
    #: ``tokens`` (scored) for token metrics, ``texts`` for embeddings
    data: dict[str, Any]
    tokens: TokenMetrics | None = None
    embeddings: EmbeddingAgreement | None = None
    #: task -> ``{"original": {metric: value}, "compressed": {...}}`` (lm-evaluation-harness)
    tasks: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)
    device: str = "cpu"
    placement: str = SIDE_BY_SIDE
    seconds: float = 0.0
    #: what was compared, as the user named them
    original: str = ""
    compressed: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, document: dict[str, Any]) -> QualityReport:
        """The report saved by :meth:`to_dict`; keys a newer layerwise added are ignored."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {key: value for key, value in document.items() if key in known}
        if isinstance(values.get("tokens"), dict):
            token_fields = {f.name for f in dataclasses.fields(TokenMetrics)}
            tokens = {k: v for k, v in values["tokens"].items() if k in token_fields}
            for name in ("kl_per_window", "kl_per_position"):
                tokens[name] = tuple(tokens.get(name) or ())
            values["tokens"] = TokenMetrics(**tokens)
        if isinstance(values.get("embeddings"), dict):
            embedding_fields = {f.name for f in dataclasses.fields(EmbeddingAgreement)}
            values["embeddings"] = EmbeddingAgreement(**{k: v for k, v in values["embeddings"].items()
                                                          if k in embedding_fields})
        return cls(**values)


def model_kind(model: torch.nn.Module) -> str:
    """``seq2seq`` for an encoder-decoder, ``causal-lm`` for a model that generates, else ``encoder``."""
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return "seq2seq"
    can_generate = getattr(model, "can_generate", None)
    return "causal-lm" if callable(can_generate) and can_generate() else "encoder"


def evaluate(original: ModelSource, compressed: ModelSource, texts: str | os.PathLike | Sequence[str] | EvalText,
             tokenizer: Any, *, window_length: int | None = None, stride: int | None = None,
             max_windows: int | None = None, batch_size: int = 1, device: str | torch.device | None = None,
             together: bool | None = None, show_progress: bool = True,
             names: tuple[str, str] = ("", "")) -> QualityReport:
    """Compare ``compressed`` with ``original`` over ``texts`` (a file, a list of strings or an
    :class:`EvalText`); returns a :class:`QualityReport`.

    ``window_length`` defaults to the model's context length, at most 2048 tokens; ``stride`` to the
    window length (no overlap); ``max_windows`` to every window the text holds. ``together``: run the
    models side by side (``True``), one at a time (``False``), or ``None``: side by side when both are
    given loaded and fit on ``device`` together, else one at a time.
    """
    start = time.perf_counter()
    text = read_eval_text(texts)
    run_on = resolve_device(device)
    if batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be 1 or more, got {batch_size} (CLI: --batch-size)")
    if together is None:
        together = _fits_together(original, compressed, run_on)
    options = _Options(tokenizer, window_length, stride, max_windows, batch_size, run_on, show_progress)
    if together:
        report = _side_by_side(_loaded(original), _loaded(compressed), text, options)
    else:
        report = _one_at_a_time(original, compressed, text, options)
    return dataclasses.replace(report, seconds=time.perf_counter() - start, original=names[0],
                               compressed=names[1])


@dataclass(frozen=True)
class _Options:
    tokenizer: Any
    window_length: int | None
    stride: int | None
    max_windows: int | None
    batch_size: int
    device: torch.device
    show_progress: bool

    def windows(self, model: torch.nn.Module, text: EvalText) -> TokenWindows:
        length = self.window_length or default_window_length(model)
        context = context_length(model)
        if context is not None and length > context:  # positions past it are garbage, not a quality measure
            raise InvalidArgumentError(f"window length {length} is longer than the model's context ({context} "
                                       f"tokens): pass window_length={context} or less (CLI: --window-length)")
        if model_kind(model) == "seq2seq" and self.stride not in (None, length):
            raise InvalidArgumentError("a seq2seq model reads each window's first half and predicts its second: "
                                       "windows may not overlap; leave --stride out (it is the window length)")
        return token_windows(text.texts, self.tokenizer, length, self.stride, self.max_windows)


def _side_by_side(original: torch.nn.Module, compressed: torch.nn.Module, text: EvalText,
                  options: _Options) -> QualityReport:
    kind = _same_kind(model_kind(original), compressed)
    tokens = embeddings = None
    data: dict[str, Any] = {"description": text.description, "sha256": text.sha256}
    with _on_device(original, options.device), _on_device(compressed, options.device):
        if kind in ("causal-lm", "seq2seq"):
            windows = options.windows(original, text)
            agreement = TokenAgreement(windows.length)
            # each batch of windows runs through the original, then the compressed model, then is compared
            pairs = zip(_predictions(original, kind, windows, options, "side by side"),
                        _predictions(compressed, kind, windows, options, None))
            for (_, reference, targets, first), (_, candidate, _, _) in pairs:
                agreement.add(reference, candidate, targets, first)
            tokens = agreement.result()
            data.update(_window_data(windows, tokens))
        if kind in ("encoder", "seq2seq"):
            embeddings = embedding_agreement(_embeddings(original, text, options),
                                             _embeddings(compressed, text, options))
            data["texts"] = embeddings.sentences
    return QualityReport(kind=kind, data=data, tokens=tokens, embeddings=embeddings, device=str(options.device),
                         placement=SIDE_BY_SIDE)


def _one_at_a_time(original: ModelSource, compressed: ModelSource, text: EvalText,
                   options: _Options) -> QualityReport:
    data: dict[str, Any] = {"description": text.description, "sha256": text.sha256}
    tokens = embeddings = None
    with tempfile.TemporaryDirectory(prefix="layerwise-eval-") as folder:
        store = Path(folder)
        with _used(original) as model, _on_device(model, options.device):
            kind = model_kind(model)
            windows = options.windows(model, text) if kind != "encoder" else None
            if windows is not None:  # the original's scored log-probabilities wait on disk
                for index, reference, _, _ in _predictions(model, kind, windows, options, "original"):
                    torch.save(reference.cpu(), store / f"{index}.pt")
            reference_embeddings = _embeddings(model, text, options) if kind != "causal-lm" else None
        with _used(compressed) as model, _on_device(model, options.device):
            _same_kind(kind, model)
            if windows is not None:
                agreement = TokenAgreement(windows.length)
                for index, candidate, targets, first in _predictions(model, kind, windows, options, "compressed"):
                    reference = torch.load(store / f"{index}.pt", mmap=True)
                    agreement.add(reference, candidate.to(reference.device), targets, first)
                tokens = agreement.result()
                data.update(_window_data(windows, tokens))
            if reference_embeddings is not None:
                embeddings = embedding_agreement(reference_embeddings, _embeddings(model, text, options))
                data["texts"] = embeddings.sentences
    return QualityReport(kind=kind, data=data, tokens=tokens, embeddings=embeddings, device=str(options.device),
                         placement=ONE_AT_A_TIME)


def _window_data(windows: TokenWindows, tokens: TokenMetrics) -> dict[str, Any]:
    return {"windows": int(windows.ids.shape[0]), "window_length": windows.length, "stride": windows.stride,
            "tokens": tokens.tokens}


def _predictions(model: torch.nn.Module, kind: str, windows: TokenWindows, options: _Options,
                 label: str | None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor, int]]:
    """``(window, log-probabilities of its scored positions, their targets, first position)`` under
    ``model``, run ``batch_size`` windows at a time; a progress bar named ``label`` (none for ``None``)."""
    from tqdm.auto import tqdm

    count = int(windows.ids.shape[0])
    # disable None: no bar where stderr is no terminal (a log would get a line per update)
    with tqdm(total=count, desc=f"eval {label}", unit="window", leave=False,
              disable=True if label is None or not options.show_progress else None) as bar:
        for begin in range(0, count, options.batch_size):
            indices = list(range(begin, min(begin + options.batch_size, count)))
            logits = _logits(model, kind, windows.ids[indices])
            for row, index in enumerate(indices):
                yield (index, *_scored(logits[row], kind, windows, index))
            bar.update(len(indices))


@torch.no_grad()
def _logits(model: torch.nn.Module, kind: str, ids: torch.Tensor) -> torch.Tensor:
    device = _device_of(model)
    if kind == "causal-lm":
        return model(input_ids=ids.to(device)).logits
    half = ids.shape[1] // 2
    source, target = ids[:, :half].to(device), ids[:, half:].to(device)
    return model(input_ids=source, decoder_input_ids=_decoder_inputs(model, target)).logits


def _decoder_inputs(model: torch.nn.Module, target: torch.Tensor) -> torch.Tensor:
    """The target shifted right behind the decoder's start token (teacher forcing)."""
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return prepare(labels=target)
    start = getattr(model.config, "decoder_start_token_id", None)
    if start is None:
        raise InvalidArgumentError(f"{type(model).__name__} names no decoder_start_token_id in its config: "
                                   f"layerwise eval cannot feed its decoder")
    return torch.cat([torch.full_like(target[:, :1], start), target[:, :-1]], dim=1)


def _scored(logits: torch.Tensor, kind: str, windows: TokenWindows, index: int
            ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One window's scored log-probabilities, their targets, and the window position of the first."""
    ids = windows.ids[index]
    if kind == "causal-lm":
        first = windows.first_scored[index]
        return log_probs(logits[first - 1:-1]), ids[first:], first
    half = windows.length // 2
    return log_probs(logits), ids[half:], half


def _embeddings(model: torch.nn.Module, text: EvalText, options: _Options) -> torch.Tensor:
    if options.tokenizer is None:
        raise InvalidArgumentError("comparing embeddings needs the model's tokenizer; pass tokenizer=")
    return sentence_embeddings(model, options.tokenizer, list(text.texts), max_length=EMBEDDING_MAX_LENGTH,
                               device=_device_of(model))


def _same_kind(kind: str, compressed: torch.nn.Module) -> str:
    if model_kind(compressed) != kind:
        raise InvalidArgumentError(f"the original is a {kind} model but the compressed one a "
                                   f"{model_kind(compressed)}: compare a model with its own compressed copy")
    return kind


def _loaded(source: ModelSource) -> torch.nn.Module:
    return source if isinstance(source, torch.nn.Module) else source()


@contextlib.contextmanager
def _used(source: ModelSource) -> Iterator[torch.nn.Module]:
    """The model, loaded when a function was given (and released after)."""
    if isinstance(source, torch.nn.Module):
        yield source
        return
    model = source()
    try:
        yield model
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _on_device(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """``model`` on ``device`` for the block, back where it was after."""
    was = _device_of(model)
    if was == device or (was.type == device.type and device.index is None):
        yield
        return
    model.to(device)
    try:
        yield
    finally:
        model.to(was)


def _device_of(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


#: share of the GPU's free memory the two models may take side by side (activations need the rest)
GPU_SHARE = 0.8


def _fits_together(original: ModelSource, compressed: ModelSource, device: torch.device) -> bool:
    """Side by side when both are loaded and, on a GPU, both fit in most of its free memory."""
    if not (isinstance(original, torch.nn.Module) and isinstance(compressed, torch.nn.Module)):
        return False
    if device.type != "cuda":
        return True
    moved = sum(_parameter_bytes(m) for m in (original, compressed) if _device_of(m).type != "cuda")
    free = free_memory(device)  # a simulated GPU's too; unknown: one at a time
    return free is not None and moved <= GPU_SHARE * free


def _parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())
