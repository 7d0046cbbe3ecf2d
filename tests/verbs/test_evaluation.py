"""``layerwise.evaluate``: folders loaded the right way, placement chosen, tasks plumbed through."""

from __future__ import annotations

import sys

import pytest
import torch

import layerwise
from layerwise.errors import InvalidArgumentError
from layerwise.reports.task_accuracy import TaskEvaluationError
from layerwise.verbs import evaluation
from tests.conftest import build_tiny_llama
from tests.plugins.savers.test_sparse_saving import write_legacy
from tests.reports.test_quality import word_texts

WANDA = "WandaModifier:\n  sparsity: 0.5\n  ignore: [lm_head]\n"


@pytest.fixture
def pruned(tiny_llama_dir, tmp_path):
    """A Wanda-pruned tiny Llama saved sparse-bitmask (transformers alone would leave its weights random)."""
    batches = [{"input_ids": torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i))}
               for i in range(2)]
    model = layerwise.compress(str(tiny_llama_dir), WANDA, dataset=batches, show_progress=False)
    # the layout older layerwise releases wrote (today's outputs are dense): it must go through load_compressed
    return model, write_legacy(tmp_path / "pruned", model)


def test_a_sparse_folder_is_decoded_before_it_is_compared(tiny_llama_dir, pruned):
    model, folder = pruned
    assert "sparse-bitmask" in (folder / "config.json").read_text()
    options = dict(window_length=32, max_windows=4, show_progress=False, device="cpu")  # side by side in RAM
    from_folders = layerwise.evaluate(tiny_llama_dir, folder, word_texts(), **options)
    in_memory = layerwise.evaluate(build_tiny_llama(), model, word_texts(), **options)
    assert from_folders.tokens.kl_mean == pytest.approx(in_memory.tokens.kl_mean, rel=1e-5)
    assert from_folders.placement == "side by side" and from_folders.compressed == str(folder)


def test_placement_is_a_choice_and_one_at_a_time_is_honoured(tiny_llama_dir):
    with pytest.raises(InvalidArgumentError, match="unknown placement 'apart'"):
        layerwise.evaluate(tiny_llama_dir, tiny_llama_dir, word_texts(), placement="apart")
    report = layerwise.evaluate(tiny_llama_dir, tiny_llama_dir, word_texts(), placement="one-at-a-time",
                                window_length=32, max_windows=2, show_progress=False)
    assert report.placement == "one at a time" and report.tokens.kl_max == 0.0


def test_auto_placement_runs_one_at_a_time_when_both_would_not_fit(tiny_llama_dir, monkeypatch):
    from layerwise.runtime import memory_policy as stream

    monkeypatch.setattr(stream, "available_memory", lambda: 1000)
    assert evaluation._fit_together(tiny_llama_dir, tiny_llama_dir, torch.device("cpu")) is False
    monkeypatch.setattr(stream, "available_memory", lambda: 1 << 40)
    assert evaluation._fit_together(tiny_llama_dir, tiny_llama_dir, torch.device("cpu")) is True
    assert evaluation._fit_together(build_tiny_llama(), build_tiny_llama(), torch.device("cpu")) is None


def test_tasks_run_on_both_models(tiny_llama_dir, monkeypatch):
    seen = []

    def fake_accuracy(model, tokenizer, tasks, **options):
        seen.append((type(model).__name__, tasks, options))
        return {"arc_easy": {"acc,none": 0.25 * len(seen)}}

    monkeypatch.setattr(evaluation, "lm_eval_modules", lambda: None)
    monkeypatch.setattr(evaluation, "task_accuracy", fake_accuracy)
    report = layerwise.evaluate(tiny_llama_dir, build_tiny_llama(), word_texts(), tasks="arc_easy",
                                task_path="tasks", task_limit=5, window_length=32, max_windows=1,
                                show_progress=False)
    assert report.tasks == {"arc_easy": {"original": {"acc,none": 0.25}, "compressed": {"acc,none": 0.5}}}
    assert [s[0] for s in seen] == ["LlamaForCausalLM", "LlamaForCausalLM"]
    assert seen[0][1] == ["arc_easy"] and seen[0][2]["task_path"] == "tasks" and seen[0][2]["limit"] == 5


def test_tasks_without_the_extra_fail_before_any_model_loads(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    with pytest.raises(TaskEvaluationError, match="layerwise\\[eval\\]"):
        layerwise.evaluate(tmp_path / "not-a-model", tmp_path / "nor-this", word_texts(), tasks="piqa")
