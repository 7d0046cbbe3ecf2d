"""Elementwise work in slices of rows: the same values as one call, joined and cast as asked."""

from __future__ import annotations

import torch

from layerwise.algorithms.quantization.slices import SLICE_ELEMENTS, by_row_slices, row_slices


def _halves_and_signs(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x.float() / scale, torch.sign(x).to(torch.int8))


def test_slices_give_one_call_s_values_cast_as_they_are_written():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, 1024, generator=generator).to(torch.bfloat16)  # several slices of rows
    scale = torch.rand(300, 1, generator=generator) + 0.5  # one per row: sliced with x
    assert len(row_slices(x)) > 1 and x[0].numel() < SLICE_ELEMENTS
    whole = _halves_and_signs(x, scale)
    values, signs = by_row_slices(_halves_and_signs, x, scale, dtypes=(torch.bfloat16, None))
    assert values.dtype == torch.bfloat16 and signs.dtype == torch.int8
    assert torch.equal(values, whole[0].to(torch.bfloat16)) and torch.equal(signs, whole[1])
    small = x[:2]  # one slice: a single call, cast the same way
    single = by_row_slices(_halves_and_signs, small, scale[:2], dtypes=(torch.bfloat16, None))
    assert single[0].dtype == torch.bfloat16 and torch.equal(single[0], whole[0][:2].to(torch.bfloat16))
    assert by_row_slices(_halves_and_signs, x, scale)[0].dtype == torch.float32  # no dtypes: the slices' own
