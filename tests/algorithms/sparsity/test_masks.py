"""Mask structures parse strictly; masks prune exactly the asked count, per row or per run of M."""

from __future__ import annotations

import pytest
import torch

from layerwise.algorithms.sparsity.masks import (
    MaskStructure,
    check_sparsity,
    magnitude_mask,
    parse_mask_structure,
    score_mask,
)
from layerwise.errors import RecipeError


@pytest.mark.parametrize("text, expected", [
    ("0:0", MaskStructure(0, 0)), ("unstructured", MaskStructure(0, 0)), (None, MaskStructure(0, 0)),
    ("2:4", MaskStructure(2, 4)), (" 1 : 4 ", MaskStructure(1, 4)), ("4:8", MaskStructure(4, 8)),
])
def test_structures_parse(text, expected):
    assert parse_mask_structure(text) == expected


@pytest.mark.parametrize("text", ["2-4", "4:2", "4:4", "0:4", "2:0", "half", 24, "2:4:8"])
def test_a_malformed_structure_is_a_named_error(text):
    with pytest.raises(RecipeError, match=r"mask_structure.*'2:4'"):
        parse_mask_structure(text)


@pytest.mark.parametrize("value", [1.0, 1.5, -0.1, float("nan"), "0.5", True])
def test_sparsity_outside_zero_one_is_a_named_error(value):
    with pytest.raises(RecipeError, match=r"SparseGPTModifier.sparsity must be a fraction in \[0, 1\)"):
        check_sparsity(value, "SparseGPTModifier.sparsity")


def test_n_m_on_a_width_m_does_not_divide_names_the_layer():
    with pytest.raises(RecipeError, match=r"layer 'mlp.down' has 30 input columns.*ignore"):
        MaskStructure(2, 4).check_columns(30, "mlp.down")


@pytest.mark.parametrize("columns, sparsity", [(64, 0.5), (30, 0.5), (33, 0.3), (10, 0.0), (7, 0.9)])
def test_unstructured_masks_prune_exactly_round_sparsity_times_width_in_every_row(columns, sparsity):
    score = torch.randn(12, columns, generator=torch.Generator().manual_seed(0))
    mask = score_mask(score, MaskStructure(0, 0), sparsity)
    expected = int(sparsity * columns + 0.5)
    assert mask.sum(dim=1).tolist() == [expected] * 12
    # the pruned ones are the lowest scores of their row
    for row, row_mask in zip(score, mask):
        if 0 < expected < columns:
            assert row[row_mask].max() < row[~row_mask].min()


@pytest.mark.parametrize("n, m", [(2, 4), (1, 4), (4, 8), (3, 4)])
def test_n_m_masks_prune_exactly_n_in_every_run_of_m(n, m):
    score = torch.randn(9, 8 * m, generator=torch.Generator().manual_seed(1))
    mask = score_mask(score, MaskStructure(n, m), n / m)
    runs = mask.reshape(9, 8, m)
    assert (runs.sum(-1) == n).all()
    values = score.reshape(9, 8, m)
    assert (values.masked_fill(~runs, -torch.inf).amax(-1) < values.masked_fill(runs, torch.inf).amin(-1)).all()


def test_magnitude_mask_prunes_the_smallest_absolute_values():
    weight = torch.tensor([[0.1, -3.0, 0.2, -0.05], [5.0, -0.01, 1.0, 2.0]])
    assert magnitude_mask(weight, MaskStructure(0, 0), 0.5).tolist() == [[True, False, False, True],
                                                                         [False, True, True, False]]
    assert magnitude_mask(weight, MaskStructure(2, 4), 0.5).tolist() == [[True, False, False, True],
                                                                         [False, True, True, False]]


def test_an_unquoted_yaml_n_m_is_an_error_that_says_to_quote_it():
    from layerwise.host.recipe import parse_recipe

    with pytest.raises(RecipeError, match=r"how YAML reads an unquoted 2:4; quote it: mask_structure: \"2:4\""):
        parse_recipe("SparseGPTModifier:\n  mask_structure: 2:4\n")
