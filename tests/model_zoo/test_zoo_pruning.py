"""Every zoo architecture prunes through the sequential pipeline: SparseGPT 2:4 from each layer's Hessian.

As for GPTQ (test_zoo_gptq.py), the richest modality is the calibration batch, so vision / audio /
decoder layers are all pruned; every targeted Linear must be solved from its own Hessian and hold
exactly 2 zeros in every run of 4 input weights.
"""

from __future__ import annotations

import pytest
import torch
from test_zoo_gptq import zoo_case
from test_zoo_patches import ARCHS, patches  # noqa: F401  (fixture)

import layerwise
from layerwise.plugins.modifiers.sparsegpt import SparseGPTModifier


@pytest.mark.parametrize("name", list(ARCHS))
def test_sparsegpt_two_four_prunes_every_targeted_linear_from_its_hessian(name, patches):  # noqa: F811
    model, patch, targets, batch, linears = zoo_case(name, patches)

    sparsegpt = SparseGPTModifier(mask_structure="2:4", block_size=16)
    layerwise.compress(model, sparsegpt, dataset=[batch], show_progress=False, options=layerwise.CompressOptions.of(pipeline="sequential", sequential_targets=targets, patch=patch))

    solved = {row["name"] for row in sparsegpt.summary if row["method"] == "sparsegpt"}
    missing = sorted(set(linears) - solved)
    assert not missing, f"{name}: not pruned from a Hessian: {missing[:5]}"
    for layer_name, layer in linears.items():
        runs = (layer.weight == 0).reshape(layer.weight.shape[0], -1, 4).sum(-1)
        assert (runs == 2).all(), f"{name}: {layer_name} is not 2:4"
    with torch.no_grad():
        assert torch.isfinite(model(**batch).logits).all()
