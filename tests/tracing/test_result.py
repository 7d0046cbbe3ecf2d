"""output_difference: the largest difference (absolute, or over the largest expected value) of two outputs,
leaving both untouched."""

from __future__ import annotations

import pytest
import torch

from layerwise.tracing.result import output_difference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_output_difference_is_the_largest_difference_and_changes_neither_output(dtype):
    expected = {"logits": torch.tensor([[1.0, -4.0], [2.0, 0.5]], dtype=dtype), "loss": None}
    got = {"logits": torch.tensor([[1.0, -3.5], [2.25, 0.5]], dtype=dtype)}
    before = (expected["logits"].clone(), got["logits"].clone())
    assert output_difference(expected, got) == 0.5
    assert output_difference(expected, got, relative=True) == 0.5 / 4.0
    assert torch.equal(expected["logits"], before[0]) and torch.equal(got["logits"], before[1])
