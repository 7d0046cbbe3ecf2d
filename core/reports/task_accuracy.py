"""Task accuracy through lm-evaluation-harness (the optional ``[eval]`` extra), from local data only.

A small bridge (run for real with lm-eval 0.4.13 on a local multiple-choice task; the tests use a
stand-in): the loaded model and its tokenizer are wrapped in lm-eval's ``HFLM`` and passed to
``lm_eval.simple_evaluate`` with the task names asked for. No hub at run time: the harness runs with
``HF_HUB_OFFLINE`` and ``HF_DATASETS_OFFLINE`` set, so a task's data must already be on this machine
(in the datasets cache, or named by a task YAML in ``task_path`` whose ``dataset_path`` is a local
folder or files). Without lm-eval installed, asking for tasks is an error that says what to install.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from layerwise.errors import InvalidArgumentError, LayerwiseError

#: what ``pip install 'layerwise[eval]'`` brings (pinned in constraints.txt; HFLM needs accelerate)
EXTRA = "eval"
DISTRIBUTION = "lm-eval"
#: numbers in lm-eval's results that are not metrics
NOT_METRICS = ("sample_len",)


class TaskEvaluationError(LayerwiseError):
    """lm-evaluation-harness is missing, or a task cannot run from the data on this machine."""


def parse_tasks(text: str | Sequence[str] | None) -> list[str]:
    """``"arc_easy,hellaswag"`` (or a list of names) -> the task names, in order, each once."""
    if text is None:
        return []
    parts = text.split(",") if isinstance(text, str) else list(text)
    names = list(dict.fromkeys(part.strip() for part in parts if part.strip()))
    if not names:
        raise InvalidArgumentError("--tasks names no task: pass comma-separated lm-eval task names, "
                                   "e.g. --tasks arc_easy,hellaswag")
    return names


def lm_eval_modules() -> tuple[Any, Any, Any]:
    """``(lm_eval, HFLM, TaskManager)``; a :class:`TaskEvaluationError` that says what to install without it."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as exc:
        raise TaskEvaluationError(
            f"task accuracy (--tasks) needs lm-evaluation-harness with its Hugging Face backend, which cannot be "
            f"imported ({exc}): pip install -c constraints.txt 'layerwise[{EXTRA}]' (it brings {DISTRIBUTION}[hf]), "
            f"or leave --tasks out for perplexity, KL divergence and agreement alone") from None
    return lm_eval, HFLM, TaskManager


def task_accuracy(model: torch.nn.Module, tokenizer: Any, tasks: Sequence[str], *,
                  task_path: str | os.PathLike | None = None, limit: int | None = None,
                  num_fewshot: int | None = None, batch_size: int = 1) -> dict[str, dict[str, float]]:
    """task -> {metric: value} for ``model`` on each of ``tasks`` (lm-eval's numeric results, stderr included)."""
    lm_eval, hflm, task_manager = lm_eval_modules()
    if task_path is not None and not Path(task_path).expanduser().is_dir():
        raise TaskEvaluationError(f"--task-path '{task_path}' is not a folder; pass the folder of your lm-eval "
                                  f"task YAML files")
    manager = task_manager(include_path=str(Path(task_path).expanduser()) if task_path else None)
    wrapped = hflm(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
    with _offline():
        try:
            output = lm_eval.simple_evaluate(model=wrapped, tasks=list(tasks), task_manager=manager, limit=limit,
                                             num_fewshot=num_fewshot)
        except (OSError, ConnectionError, ValueError, KeyError) as exc:
            raise TaskEvaluationError(
                f"lm-eval could not run task(s) {', '.join(tasks)} from the data on this machine: {exc}. "
                f"layerwise runs tasks offline: put the task's data in the datasets cache, or pass --task-path "
                f"with task YAML files whose dataset_path is a local folder") from exc
    results = (output or {}).get("results") or {}
    return {task: {metric: float(value) for metric, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                   and metric not in NOT_METRICS}
            for task, metrics in results.items()}


#: (module, attribute) flags read at import time: set for the run too, as the variables come too late
_OFFLINE_FLAGS = (("huggingface_hub.constants", "HF_HUB_OFFLINE"), ("datasets.config", "HF_DATASETS_OFFLINE"),
                  ("datasets.config", "HF_HUB_OFFLINE"))


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """No hub and no dataset download while the harness runs (everything is restored after)."""
    import sys

    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, "1"))
    flags = [(sys.modules[module], attribute) for module, attribute in _OFFLINE_FLAGS
             if hasattr(sys.modules.get(module), attribute)]
    before = [getattr(module, attribute) for module, attribute in flags]
    for module, attribute in flags:
        setattr(module, attribute, True)
    try:
        yield
    finally:
        for (module, attribute), value in zip(flags, before):
            setattr(module, attribute, value)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
