"""Layers reading one tensor share its fake quantization only while the tensor, the args and the scales are
what it was computed from; a model computes the same logits with and without the sharing."""

from __future__ import annotations

import gc

import pytest
import torch

import layerwise
from layerwise.algorithms.quantization import shared_inputs
from layerwise.algorithms.quantization.presets import PRESETS
from layerwise.algorithms.quantization.qmath import fake_quantize_activation
from layerwise.algorithms.quantization.shared_inputs import quantized_input
from layerwise.testing import token_batches
from tests.conftest import build_tiny_llama

NVFP4 = PRESETS["NVFP4"].input_activations
W8A8 = PRESETS["W8A8"].input_activations


@pytest.fixture
def calls(monkeypatch):
    """How many times the activations were fake-quantized."""
    counted = []

    def counting(*args, **kwargs):
        counted.append(1)
        return fake_quantize_activation(*args, **kwargs)

    monkeypatch.setattr(shared_inputs, "fake_quantize_activation", counting)
    return counted


def test_the_same_tensor_with_equal_args_and_scales_is_quantized_once(calls):
    x = torch.randn(4, 64)
    first = quantized_input(x, NVFP4, global_scale=torch.tensor([30.0]))
    again = quantized_input(x, NVFP4.replace(), global_scale=torch.tensor([30.0]))  # equal, not the same objects
    assert again is first and len(calls) == 1
    assert torch.equal(first, fake_quantize_activation(x, NVFP4, global_scale=torch.tensor([30.0])))


def test_anything_changed_quantizes_again(calls):
    x, scale = torch.randn(4, 64), torch.tensor([30.0])
    results = [quantized_input(x, NVFP4, global_scale=scale)]
    results.append(quantized_input(x, NVFP4, global_scale=torch.tensor([31.0])))  # another scale
    results.append(quantized_input(x, W8A8))  # other args
    scale.mul_(2.0)  # the scale buffer changed in place
    results.append(quantized_input(x, NVFP4, global_scale=scale))
    results[-1].add_(1.0)  # a reader changed the result in place
    results.append(quantized_input(x, NVFP4, global_scale=scale))
    x.mul_(3.0)  # the input changed in place
    results.append(quantized_input(x, NVFP4, global_scale=scale))
    assert len(calls) == len(results) == 6
    assert torch.equal(results[-1], fake_quantize_activation(x, NVFP4, global_scale=scale))
    assert not torch.equal(results[-1], results[-2] - 1.0)


def test_nothing_is_shared_under_autograd_or_in_inference_mode(calls):
    x = torch.randn(4, 64, requires_grad=True)
    assert quantized_input(x, W8A8) is not quantized_input(x, W8A8)
    with torch.inference_mode():
        y = torch.randn(4, 64)
        assert torch.equal(quantized_input(y, W8A8), quantized_input(y, W8A8))
    assert len(calls) == 4


def test_a_freed_input_frees_its_result():
    x = torch.randn(4, 64)
    quantized_input(x, W8A8)
    assert shared_inputs._LAST[0] is not None
    del x
    gc.collect()
    assert shared_inputs._LAST[0] is None


@pytest.mark.parametrize("preset", ["NVFP4", "W8A8"])
def test_a_model_computes_the_same_with_and_without_sharing(preset, monkeypatch, calls):
    model = build_tiny_llama(hidden_size=64, intermediate_size=128)
    batches = token_batches(2, 16, vocab=128)
    layerwise.compress(model, preset, **({"dataset": batches} if preset == "NVFP4" else {}), show_progress=False)
    calls.clear()
    with torch.no_grad():
        shared = model(**batches[0]).logits
    assert len(calls) == 4 * len(model.model.layers)  # q/k/v, o, gate/up, down: four inputs a block, not seven
    monkeypatch.setattr(shared_inputs, "_shareable", lambda x, qparams: False)
    with torch.no_grad():
        alone = model(**batches[0]).logits
    assert len(calls) == 4 * len(model.model.layers) + 7 * len(model.model.layers)
    assert torch.equal(shared, alone)
