"""The lm-evaluation-harness bridge: the error without it, and what it passes and reads (a stand-in harness)."""

from __future__ import annotations

import os
import sys
import types

import pytest

from layerwise.errors import InvalidArgumentError
from layerwise.reports.task_accuracy import (
    TaskEvaluationError,
    lm_eval_modules,
    parse_tasks,
    task_accuracy,
)


def test_without_lm_eval_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    with pytest.raises(TaskEvaluationError, match=r"pip install -c constraints.txt 'layerwise\[eval\]'.*lm-eval\[hf\]"):
        lm_eval_modules()


def test_task_names_are_parsed():
    assert parse_tasks("arc_easy, hellaswag,arc_easy") == ["arc_easy", "hellaswag"]
    assert parse_tasks(["piqa"]) == ["piqa"] and parse_tasks(None) == []
    with pytest.raises(InvalidArgumentError, match="names no task"):
        parse_tasks(" , ")


@pytest.fixture
def fake_lm_eval(monkeypatch):
    """A stand-in ``lm_eval`` that records its calls and returns fixed results."""
    calls: dict = {}

    class HFLM:
        def __init__(self, **kwargs):
            calls["hflm"] = kwargs

    class TaskManager:
        def __init__(self, include_path=None):
            calls["include_path"] = include_path

    def simple_evaluate(**kwargs):
        calls["evaluate"] = kwargs
        calls["offline"] = os.environ.get("HF_DATASETS_OFFLINE"), os.environ.get("HF_HUB_OFFLINE")
        if kwargs["tasks"] == ["missing"]:
            raise ConnectionError("Couldn't reach the hub")
        return {"results": {"arc_easy": {"alias": "arc_easy", "acc,none": 0.5, "acc_stderr,none": 0.01,
                                         "broken": float("nan"), "sample_len": 20}}}

    root = types.ModuleType("lm_eval")
    root.simple_evaluate = simple_evaluate
    models, huggingface, tasks = (types.ModuleType(n) for n in ("lm_eval.models", "lm_eval.models.huggingface",
                                                                  "lm_eval.tasks"))
    huggingface.HFLM, tasks.TaskManager = HFLM, TaskManager
    for name, module in {"lm_eval": root, "lm_eval.models": models, "lm_eval.models.huggingface": huggingface,
                         "lm_eval.tasks": tasks}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    return calls


def test_the_bridge_passes_the_model_tasks_and_local_task_folder(fake_lm_eval, tmp_path):
    model, tokenizer = object(), object()
    results = task_accuracy(model, tokenizer, ["arc_easy"], task_path=tmp_path, limit=20, num_fewshot=0,
                            batch_size=2)
    assert results == {"arc_easy": {"acc,none": 0.5, "acc_stderr,none": 0.01}}
    assert fake_lm_eval["hflm"] == {"pretrained": model, "tokenizer": tokenizer, "batch_size": 2}
    assert fake_lm_eval["include_path"] == str(tmp_path)
    called = fake_lm_eval["evaluate"]
    assert called["tasks"] == ["arc_easy"] and called["limit"] == 20 and called["num_fewshot"] == 0
    assert fake_lm_eval["offline"] == ("1", "1")  # no hub while the harness runs
    assert "HF_DATASETS_OFFLINE" not in os.environ  # and the environment is restored after


def test_a_task_without_local_data_is_a_named_error(fake_lm_eval, tmp_path):
    with pytest.raises(TaskEvaluationError, match="from the data on this machine.*--task-path"):
        task_accuracy(object(), object(), ["missing"])
    with pytest.raises(TaskEvaluationError, match="is not a folder"):
        task_accuracy(object(), object(), ["arc_easy"], task_path=tmp_path / "nowhere")
