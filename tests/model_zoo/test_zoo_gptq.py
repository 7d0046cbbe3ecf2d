"""Every zoo architecture calibrates with GPTQ through the sequential pipeline, towers included.

The richest modality each patch supports (image for the vision-language models, audio for
Whisper) is the calibration batch, so every vision / audio / decoder layer is its own
subgraph and every targeted Linear in it must be GPTQ-quantized from its own Hessian.
"""

from __future__ import annotations

import pytest
import torch
from test_zoo_patches import ARCHS, _built, _modality_targets, patches  # noqa: F401  (fixture)

import layerwise
from layerwise.common.matching import find_modules
from layerwise.plugins.modifiers.gptq import GPTQModifier


def _richest(modalities):
    return next(m for m in ("image", "audio", "text") if m in modalities)


def zoo_case(name, patches):  # noqa: F811
    """A zoo model, its patch, the targets and batch of its richest modality, and the Linears inside them."""
    model, patch = _built(name, patches)
    modality = _richest(ARCHS[name].modalities)
    targets = list(_modality_targets(patch, modality))
    batch = patch.sample_inputs(model.config, modality)
    layer_names = find_modules(model, targets, patch.ignore)
    linears = {n: m for n, m in find_modules(model, ["Linear"], patch.ignore).items()
               if any(n.startswith(layer + ".") for layer in layer_names)}
    assert linears, f"{name}: no Linear inside the targets"
    return model, patch, targets, batch, linears


@pytest.mark.parametrize("name", list(ARCHS))
def test_gptq_through_the_sequential_pipeline_changes_every_targeted_linear(name, patches):  # noqa: F811
    model, patch, targets, batch, linears = zoo_case(name, patches)
    before = {n: m.weight.detach().clone() for n, m in linears.items()}

    # tiny widths (32, 64): per-channel int4, so no group size has to divide them
    gptq = GPTQModifier(scheme="W4A16", strategy="channel", block_size=16)
    layerwise.compress(model, gptq, dataset=[batch], show_progress=False, options=layerwise.CompressOptions.of(pipeline="sequential", sequential_targets=targets, patch=patch))  # the patch's ignore list by default

    report = model.layerwise_report
    assert report.pipeline == "sequential"
    solved = {row["name"] for row in gptq.summary if row["method"] == "gptq"}
    towers_missing = sorted(set(linears) - solved)
    assert not towers_missing, f"{name}: not GPTQ-solved from a Hessian: {towers_missing[:5]}"
    unchanged = [n for n, m in linears.items() if torch.equal(m.weight, before[n])]
    assert not unchanged, f"{name}: weights unchanged: {unchanged[:5]}"
    with torch.no_grad():
        assert torch.isfinite(model(**batch).logits).all()

