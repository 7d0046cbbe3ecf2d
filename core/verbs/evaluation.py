"""``evaluate()``: how much a compressed model lost against its original, from folders or loaded models.

What is given as a path is loaded here: the original with :func:`layerwise.load_model`, the compressed
folder with :func:`layerwise.load_compressed` (which also decodes the pruned layouts transformers no
longer reads). ``placement="auto"`` runs the two side by side when both fit in the memory available
(and on the GPU, when one runs), else one at a time; the measuring itself is
:func:`layerwise.reports.quality.evaluate`. Task accuracy (lm-evaluation-harness) is added when
``tasks`` are asked for. :func:`record_evaluation` saves the result with a compressed folder: into its
``layerwise_summary.json``, its model card and the card's pictures.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from layerwise.common.quiet import library_bars_follow_show_progress
from layerwise.errors import check_choice
from layerwise.reports.eval_text import read_eval_text
from layerwise.reports.quality import GPU_SHARE, ModelSource, QualityReport
from layerwise.reports.quality import evaluate as evaluate_models
from layerwise.reports.task_accuracy import lm_eval_modules, parse_tasks, task_accuracy
from layerwise.runtime.devices import free_memory, resolve_device

PLACEMENTS = ("auto", "side-by-side", "one-at-a-time")
#: loading a model whole takes about this many times its checkpoint's bytes (as for compress)
LOAD_PEAK = 1.5

ModelLike = torch.nn.Module | str | os.PathLike


@library_bars_follow_show_progress
def evaluate(original: ModelLike, compressed: ModelLike, dataset: str | os.PathLike | Sequence[str], *,
             tokenizer: Any = None, window_length: int | None = None, stride: int | None = None,
             max_windows: int | None = None, batch_size: int = 1, device: str | torch.device | None = None,
             placement: str = "auto", tasks: str | Sequence[str] | None = None,
             task_path: str | os.PathLike | None = None, task_limit: int | None = None,
             num_fewshot: int | None = None, show_progress: bool = True,
             trust_remote_code: bool = False) -> QualityReport:
    """Compare ``compressed`` with ``original`` (folders, hub ids or loaded models) over ``dataset``
    (a .txt / .jsonl file or a list of strings); returns a
    :class:`~layerwise.reports.quality.QualityReport`.

    ``tokenizer`` defaults to the compressed folder's, else the original's. ``placement``:
    ``"side-by-side"``, ``"one-at-a-time"`` or ``"auto"``. ``tasks`` (lm-eval task names, with
    ``task_path`` a folder of task YAMLs, ``task_limit`` examples per task, ``num_fewshot``) need
    ``pip install 'layerwise[eval]'`` and the tasks' data on this machine. Everything a user typed is
    checked before a model loads.
    """
    check_choice(placement, PLACEMENTS, "placement", "--placement")
    task_names = parse_tasks(tasks) if tasks is not None else []
    if task_names:
        lm_eval_modules()  # a missing extra is an error now, not after the models ran
    text = read_eval_text(dataset)
    run_on = resolve_device(device)
    for given in (original, compressed):
        if not isinstance(given, torch.nn.Module):
            from layerwise.model_io.model_paths import check_model_path

            check_model_path(given)
    _check_original_unquantized(original)
    if tokenizer is None:
        tokenizer = _tokenizer_of(compressed, original, trust_remote_code)
    together = {"side-by-side": True, "one-at-a-time": False}.get(placement)
    if together is None:
        together = _fit_together(original, compressed, run_on)
    report = evaluate_models(_source(original, "original", trust_remote_code),
                             _source(compressed, "compressed", trust_remote_code), text, tokenizer,
                             window_length=window_length, stride=stride, max_windows=max_windows,
                             batch_size=batch_size, device=run_on, together=together, show_progress=show_progress,
                             names=(_name(original), _name(compressed)))
    if task_names:
        runs: dict[str, dict[str, dict[str, float]]] = {}
        for role, given in (("original", original), ("compressed", compressed)):
            model = _source(given, role, trust_remote_code)
            loaded = model if isinstance(model, torch.nn.Module) else model()
            for task, metrics in task_accuracy(loaded, tokenizer, task_names, task_path=task_path,
                                               limit=task_limit, num_fewshot=num_fewshot,
                                               batch_size=batch_size).items():
                runs.setdefault(task, {})[role] = metrics
            del loaded
        report = dataclasses.replace(report, tasks=runs)
    return report


def record_evaluation(folder: str | os.PathLike, quality: QualityReport) -> tuple[Path, Path | None]:
    """Save ``quality`` with the compressed ``folder`` (a layerwise output): into its summary, its model
    card and the card's pictures. Returns the summary's path and the card's (``None`` when the folder's
    ``README.md`` is the user's: kept as it is)."""
    from layerwise.reports.model_card import write_card
    from layerwise.reports.run_summary import read_summary, record_quality

    summary_path = record_quality(folder, quality.to_dict())
    return summary_path, write_card(folder, read_summary(folder))


def _check_original_unquantized(original: ModelLike) -> None:
    """The original is the unquantized model a compressed one came from; a quantized folder there measures
    nothing meaningful (and a plain load of an FP4 one fails its forward): refused, naming what it holds."""
    from layerwise.model_io.model_paths import (
        AlreadyQuantizedError,
        describe_quantization,
        folder_quantization,
    )

    quant = None if isinstance(original, torch.nn.Module) else folder_quantization(original)
    if quant:
        raise AlreadyQuantizedError(f"the original {str(original)!r} is already quantized "
                                    f"({describe_quantization(quant)}): eval compares a compressed model with the "
                                    f"unquantized model it came from; pass that model's folder or hub id as ORIGINAL")


def evaluate_output(output_dir: str | os.PathLike, original: ModelLike, dataset: Any, **options: Any
                    ) -> QualityReport:
    """``compress --eval``: the saved ``output_dir`` against ``original``, recorded in the folder."""
    quality = evaluate(original, output_dir, dataset, **options)
    record_evaluation(output_dir, quality)
    return quality


def _source(given: ModelLike, role: str, trust_remote_code: bool) -> ModelSource:
    """A loaded model as it is; a path as a function that loads it."""
    if isinstance(given, torch.nn.Module):
        return given

    def load() -> torch.nn.Module:
        if role == "original":
            from layerwise.model_io.loading import load_model

            return load_model(given, trust_remote_code=trust_remote_code)
        from layerwise.model_io.compressed_loading import load_compressed

        return load_compressed(given, dtype="auto", trust_remote_code=trust_remote_code).eval()

    return load


def _tokenizer_of(compressed: ModelLike, original: ModelLike, trust_remote_code: bool) -> Any:
    from layerwise.model_io.loading import load_tokenizer

    for given in (compressed, original):
        where = given if not isinstance(given, torch.nn.Module) else \
            getattr(getattr(given, "config", None), "_name_or_path", None)
        if where:
            found = load_tokenizer(where, trust_remote_code)
            if found is not None:
                return found
    return None


def _fit_together(original: ModelLike, compressed: ModelLike, device: torch.device) -> bool | None:
    """Side by side when both loaded models fit in the memory available (and the GPU's), else one at a time;
    ``None`` (let the measuring decide) when both are loaded already."""
    if isinstance(original, torch.nn.Module) and isinstance(compressed, torch.nn.Module):
        return None
    from layerwise.model_io.streaming.checkpoint import checkpoint_bytes
    from layerwise.runtime.memory_policy import available_memory

    sizes = [_loaded_bytes(m) if isinstance(m, torch.nn.Module) else checkpoint_bytes(m)
             for m in (original, compressed)]
    if any(size is None for size in sizes):
        return False
    # the compressed folder loads dequantized: about the original's size
    need = 2 * max(sizes) * LOAD_PEAK
    free = available_memory()
    if free is not None and need > free:
        return False
    if device.type != "cpu":  # free_memory knows a simulated GPU too; a device that cannot say: one at a time
        on_device = free_memory(device)
        return on_device is not None and 2 * max(sizes) <= GPU_SHARE * on_device
    return True


def _loaded_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _name(given: ModelLike) -> str:
    return type(given).__name__ if isinstance(given, torch.nn.Module) else str(given)
