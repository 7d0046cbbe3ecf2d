"""Target resolution shared by the pipelines that do not trace (``layer_sequential``)."""

from __future__ import annotations

import pytest
import torch

from layerwise.host.pipeline import PipelineFailed
from layerwise.plugins.pipelines._common import resolve_targets


def _blocks(n: int) -> torch.nn.Module:
    block = lambda: torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.ModuleList(block() for _ in range(n)))


def test_no_patterns_fall_back_to_the_blocks_found_by_structure() -> None:
    assert resolve_targets(_blocks(3), []) == ["1.0", "1.1", "1.2"]
    assert resolve_targets(_blocks(3), [], ignore=["1.1"]) == ["1.0", "1.2"]


def test_nothing_to_find_is_a_pipeline_failure_that_says_what_to_pass() -> None:
    with pytest.raises(PipelineFailed, match="no list of repeated blocks.*sequential_targets="):
        resolve_targets(_blocks(1), [])
