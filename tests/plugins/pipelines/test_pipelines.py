"""Pipeline details: independent runs, the patch's calibration context, progress, registration."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch

from layerwise.host.model_patch import ModelPatch
from layerwise.host.modifier import Modifier
from layerwise.host.pipeline import PipelineOptions
from layerwise.host.plugin_manager import registry
from tests.conftest import build_tiny_llama
from tests.plugins.pipelines.helpers import RoundingModifier, make_batches, make_lifecycle


def run(pipeline, model, lifecycle, **kw):
    options = PipelineOptions(sequential_targets=["LlamaDecoderLayer"], show_progress=kw.pop("show_progress", False),
                              **kw)
    registry("pipelines").get(pipeline)().run(model, make_batches(), lifecycle, options)


def test_every_builtin_pipeline_is_registered():
    assert set(registry("pipelines").names()) >= {"basic", "layer_sequential", "sequential", "independent",
                                                  "datafree"}


@dataclass
class Recorder(Modifier):
    requires_data: ClassVar[bool] = True
    log: list = None

    def on_calibration_start(self, state):
        self.log.append((id(self), "start"))

    def on_sequential_epoch_end(self, state, modules):
        self.log.append((id(self), "epoch"))

    def on_calibration_end(self, state):
        self.log.append((id(self), "end"))


def test_independent_gives_each_modifier_its_own_calibration_run():
    log = []
    first, second = Recorder(log=log), Recorder(log=log)
    model = build_tiny_llama()
    run("independent", model, make_lifecycle(model, first, second))
    owners = [owner for owner, _ in log]
    # all of first's events, then all of second's: two separate passes (sequential: 2 layers + head)
    assert owners == [id(first)] * 5 + [id(second)] * 5
    assert [e for _, e in log][:5] == ["start", "epoch", "epoch", "epoch", "end"]


def test_independent_later_modifier_sees_the_earlier_ones_compressed_model():
    model = build_tiny_llama()
    coarse, spy = RoundingModifier(grid=0.5), RoundingModifier(grid=1e-9)
    run("independent", model, make_lifecycle(model, coarse, spy))
    reference = build_tiny_llama()
    alone = RoundingModifier(grid=1e-9)
    run("sequential", reference, make_lifecycle(reference, alone))
    first = "model.layers.0.self_attn.q_proj"
    # same inputs reach layer 0 either way; layer 1 sees the coarse-rounded layer 0 only in the independent run
    assert torch.equal(spy.seen[first][0], alone.seen[first][0])
    assert not torch.equal(spy.seen["model.layers.1.self_attn.q_proj"][0],
                           alone.seen["model.layers.1.self_attn.q_proj"][0])


@pytest.mark.parametrize("pipeline", ["basic", "layer_sequential", "sequential", "datafree"])
def test_patch_calibration_context_wraps_calibration(pipeline):
    entered = []

    @contextlib.contextmanager
    def context(model):
        entered.append("in")
        try:
            yield
        finally:
            entered.append("out")

    model = build_tiny_llama()
    patch = ModelPatch(name="test", calibration_context=context)
    modifier = RoundingModifier()
    run(pipeline, model, make_lifecycle(model, modifier, patch=patch))
    assert entered == ["in", "out"]
    assert modifier.events[0] == ("calibration_start",) and modifier.events[-1] == ("calibration_end",)


def test_progress_bar_per_target_on_a_terminal_only(capsys, monkeypatch):
    import sys

    for terminal in (True, False):  # redirected to a log, a bar would write a line per update
        monkeypatch.setattr(sys.stderr, "isatty", lambda terminal=terminal: terminal)
        model = build_tiny_llama()
        run("layer_sequential", model, make_lifecycle(model, RoundingModifier()), show_progress=True)
        err = capsys.readouterr().err
        assert ("calibrating targets" in err and "capturing inputs" in err) is terminal


def test_sequential_frees_each_value_after_its_last_consumer(monkeypatch):
    from layerwise.plugins.pipelines import sequential
    from layerwise.runtime.cache import IntermediatesCache

    held = []

    class Watched(IntermediatesCache):
        def free(self, names, batch=None):
            super().free(names, batch)
            if batch is None:  # the end of a piece (each batch's own inputs may go as soon as it ran)
                held.append((sorted(self.names(0)), self.size_bytes()))

    monkeypatch.setattr(sequential, "IntermediatesCache", Watched)
    model = build_tiny_llama(num_hidden_layers=3)
    run("sequential", model, make_lifecycle(model, RoundingModifier()))
    assert len(held) == 4  # one free per subgraph
    names = [n for n, _ in held]
    assert "input_ids" not in names[0]
    assert not any("model_layers_0" in n for n in names[1:])  # layer 0's output gone once layer 1 ran
    assert names[-1] == [] and held[-1][1] == 0  # nothing left after the head
    assert held[0][1] > 0


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x, scale=1.0):
        return self.fc(x) * scale


class _Reused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block()])

    def forward(self, x):
        return self.blocks[0](self.blocks[0](x))


class _PerLayerArgs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        return self.blocks[1](self.blocks[0](x, scale=1.0), scale=0.5)


@pytest.mark.parametrize("model, why", [(_Reused(), "runs more than once"),
                                        (_PerLayerArgs(), "gets other arguments than 'blocks.0'")])
def test_layer_sequential_refuses_non_chains_before_calibration(model, why):
    from layerwise.host.pipeline import PipelineFailed

    modifier = RoundingModifier()
    options = PipelineOptions(sequential_targets=["_Block"], show_progress=False)
    with pytest.raises(PipelineFailed, match=why):
        registry("pipelines").get("layer_sequential")().run(model, [{"x": torch.randn(2, 4)}],
                                                            make_lifecycle(model, modifier), options)
    assert modifier.events == []
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_layer_sequential_skips_ignored_targets():
    model = build_tiny_llama(num_hidden_layers=3)
    modifier = RoundingModifier()
    options = PipelineOptions(sequential_targets=["LlamaDecoderLayer"], ignore=["model.layers.1"],
                              show_progress=False)
    # layers.1 ignored: layers.2's input is no longer layers.0's output, so this is not a chain any more
    from layerwise.host.pipeline import PipelineFailed

    with pytest.raises(PipelineFailed, match="not the output of 'model.layers.0'"):
        registry("pipelines").get("layer_sequential")().run(model, make_batches(), make_lifecycle(model, modifier),
                                                            options)
