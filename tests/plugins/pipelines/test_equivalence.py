"""basic, layer_sequential and sequential calibrate the same way; propagation changes only later layers."""

from __future__ import annotations

import pytest
import torch

from layerwise.host.pipeline import PipelineOptions
from layerwise.host.plugin_manager import registry
from tests.conftest import build_tiny_llama
from tests.plugins.pipelines.helpers import RoundingModifier, make_batches, make_lifecycle


def calibrate(pipeline, propagate, layers=3, batches=None):
    model = build_tiny_llama(num_hidden_layers=layers)
    modifier = RoundingModifier()
    lifecycle = make_lifecycle(model, modifier)
    options = PipelineOptions(sequential_targets=["LlamaDecoderLayer"], propagate_error=propagate,
                              show_progress=False)
    registry("pipelines").get(pipeline)().run(model, batches or make_batches(), lifecycle, options)
    return model, modifier


def assert_same_calibration(a, b):
    (model_a, mod_a), (model_b, mod_b) = a, b
    assert sorted(mod_a.seen) == sorted(mod_b.seen) and mod_a.seen
    for name in mod_a.seen:
        assert len(mod_a.seen[name]) == len(mod_b.seen[name]) == 3
        for x, y in zip(mod_a.seen[name], mod_b.seen[name]):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    for (name, p), (_, q) in zip(model_a.named_parameters(), model_b.named_parameters()):
        assert torch.equal(p, q), name
    assert sorted(mod_a.rounded) == sorted(mod_b.rounded)


@pytest.mark.parametrize("pipeline", ["layer_sequential", "sequential"])
def test_same_as_basic_without_propagation(pipeline):
    assert_same_calibration(calibrate("basic", False), calibrate(pipeline, False))


def test_layer_sequential_equals_sequential_with_propagation():
    assert_same_calibration(calibrate("layer_sequential", True), calibrate("sequential", True))


@pytest.mark.parametrize("pipeline", ["layer_sequential", "sequential"])
def test_propagation_changes_only_layers_after_the_first(pipeline):
    _, off = calibrate(pipeline, False)
    _, on = calibrate(pipeline, True)
    for name in off.seen:
        same = all(torch.equal(x, y) for x, y in zip(off.seen[name], on.seen[name]))
        if name.startswith("model.layers.0."):
            assert same, f"{name} saw other inputs although nothing before it was compressed"
        elif name.endswith(("q_proj", "k_proj", "v_proj")) and not name.startswith("model.layers.0."):
            # the first Linear of each later layer sees the compressed layers' output
            assert not same, f"{name} saw the uncompressed model's activations with propagation on"


def test_events_fire_in_order_per_piece():
    _, modifier = calibrate("sequential", True)
    kinds = [e[0] for e in modifier.events]
    assert kinds[0] == "calibration_start" and kinds[-1] == "calibration_end"
    pieces = [e[1] for e in modifier.events if e[0] == "sequential_epoch_end"]
    assert len(pieces) == 4  # three decoder layers plus the head
    for i in range(3):
        assert f"model.layers.{i}" in pieces[i]
    assert "lm_head" in pieces[3]
    _, modifier = calibrate("layer_sequential", True)
    pieces = [e[1] for e in modifier.events if e[0] == "sequential_epoch_end"]
    assert pieces == [("model.layers.0",), ("model.layers.1",), ("model.layers.2",)]
    _, modifier = calibrate("basic", True)
    (piece,) = [e[1] for e in modifier.events if e[0] == "sequential_epoch_end"]
    assert "model.layers.2.mlp.down_proj" in piece and "lm_head" in piece


@pytest.mark.parametrize("pipeline", ["basic", "layer_sequential", "sequential"])
def test_hooks_removed_and_model_state_restored(pipeline):
    model, modifier = calibrate(pipeline, True)
    assert not modifier._hooks
    for module in model.modules():
        assert not module._forward_pre_hooks and not module._forward_hooks
    assert model.config.use_cache is True


def test_disk_offload_gives_the_same_result(tmp_path):
    model = build_tiny_llama(num_hidden_layers=2)
    modifier = RoundingModifier()
    options = PipelineOptions(sequential_targets=["LlamaDecoderLayer"], offload="disk",
                              offload_dir=str(tmp_path), show_progress=False)
    registry("pipelines").get("sequential")().run(model, make_batches(), make_lifecycle(model, modifier), options)
    reference = calibrate("sequential", True, layers=2)[0]
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    assert list(tmp_path.iterdir()) == []  # the cache's folder is gone
