"""The built-in modifiers run through every pipeline (skipped until a modifier lands)."""

from __future__ import annotations

import pytest
import torch

from layerwise.host.pipeline import PipelineOptions
from layerwise.host.plugin_manager import registry
from tests.conftest import build_tiny_llama
from tests.plugins.pipelines.helpers import make_batches, make_lifecycle


def quantized(pipeline, modifier_name, **fields):
    modifiers = registry("modifiers")
    if modifier_name not in modifiers:
        pytest.skip(f"{modifier_name} has not landed yet")
    model = build_tiny_llama()
    modifier = modifiers.get(modifier_name)(**fields)
    lifecycle = make_lifecycle(model, modifier)
    options = PipelineOptions(sequential_targets=["LlamaDecoderLayer"], propagate_error=False, show_progress=False)
    registry("pipelines").get(pipeline)().run(model, make_batches(), lifecycle, options)
    lifecycle.finalize()
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())  # qparams are non-persistent buffers
    return {n: t.detach().clone() for n, t in tensors.items()}


@pytest.mark.parametrize("pipeline", ["basic", "layer_sequential", "sequential"])
def test_rtn_same_through_every_pipeline(pipeline):
    fields = dict(scheme="W4A16", strategy="channel")
    reference = quantized("datafree", "QuantizationModifier", **fields)
    got = quantized(pipeline, "QuantizationModifier", **fields)
    assert reference.keys() == got.keys() and any(k.endswith("weight_scale") for k in got)
    for name in reference:
        assert torch.equal(reference[name], got[name]), name


def test_gptq_same_through_every_pipeline():
    fields = dict(scheme="W4A16", strategy="channel")
    results = [quantized(p, "GPTQModifier", **fields) for p in ("basic", "layer_sequential", "sequential")]
    for other in results[1:]:
        assert results[0].keys() == other.keys()
        for name in results[0]:
            torch.testing.assert_close(results[0][name], other[name], rtol=0, atol=1e-6, msg=name)
