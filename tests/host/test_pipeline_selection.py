"""Pipeline selection and the fallback chain: warnings that say why, fatal errors never swallowed."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

from layerwise.host.hookspecs import hookimpl
from layerwise.host.modifier import Modifier
from layerwise.host.pipeline import Pipeline, PipelineFailed, PipelineOptions
from layerwise.host.pipeline_selection import (
    DEFAULT_CHAIN,
    PipelineAborted,
    PipelineFallbackWarning,
    run_pipeline,
    select_pipeline,
)
from layerwise.host.plugin_manager import get_host
from tests.conftest import build_tiny_llama
from tests.plugins.pipelines.helpers import RoundingModifier, make_batches, make_lifecycle


class Untraceable(nn.Module):
    """A tiny Llama behind a forward the tracer cannot follow (values leave torch via tolist)."""

    _no_split_modules = ["LlamaDecoderLayer"]

    def __init__(self):
        super().__init__()
        self.model = build_tiny_llama()  # RoundingModifier looks at model.layers.*

    def forward(self, input_ids, attention_mask=None):
        return torch.tensor(self.model(input_ids=input_ids, attention_mask=attention_mask).logits.tolist())


@dataclass
class DataFree(Modifier):
    requires_data: ClassVar[bool] = False

    def __post_init__(self):
        super().__post_init__()
        self.pieces = []

    def on_sequential_epoch_end(self, state, modules):
        self.pieces.append(list(modules))


def options(**kw):
    return PipelineOptions(sequential_targets=["LlamaDecoderLayer"], show_progress=False, **kw)


def no_hooks_left(model, *modifiers):
    return all(not m._hooks for m in modifiers) and all(
        not mod._forward_pre_hooks and not mod._forward_hooks for mod in model.modules())


# -- selection ---------------------------------------------------------------------------------
def test_datafree_for_data_free_modifiers():
    model = build_tiny_llama()
    assert select_pipeline(model, [DataFree()]) == ["datafree"]
    assert select_pipeline(model, [DataFree(), RoundingModifier()]) == list(DEFAULT_CHAIN)
    assert select_pipeline(model, [DataFree()], requested="basic") == ["basic"]
    modifier = DataFree()
    assert run_pipeline(model, [], make_lifecycle(model, modifier), options()) == "datafree"
    (piece,) = modifier.pieces
    assert "model.layers.1.mlp.up_proj" in piece and "lm_head" in piece


def test_plugin_choice_comes_first_then_the_default_chain():
    class Chooser:
        @hookimpl
        def layerwise_select_pipeline(self, model, modifiers):
            return "basic"

    host = get_host()
    host.register(Chooser(), name="test-chooser")
    try:
        assert select_pipeline(build_tiny_llama(), [RoundingModifier()]) == ["basic", "sequential", "layer_sequential"]
    finally:
        host.unregister("test-chooser")
    assert select_pipeline(build_tiny_llama(), [RoundingModifier()]) == list(DEFAULT_CHAIN)


# -- fallback --------------------------------------------------------------------------------
def test_untraceable_model_falls_back_to_layer_sequential_with_a_warning():
    model = Untraceable().eval()
    modifier = RoundingModifier()
    with pytest.warns(PipelineFallbackWarning, match=r"(?s)pipeline 'sequential' cannot calibrate Untraceable, "
                                                     r"falling back to 'layer_sequential'\. Why: tracing failed: "
                                                     r".*layers\.0: swallowed"):
        used = run_pipeline(model, make_batches(), make_lifecycle(model, modifier), options())
    assert used == "layer_sequential"
    assert len(modifier.rounded) == 14  # 2 layers x 7 Linears
    assert no_hooks_left(model, modifier)


def test_a_named_pipeline_is_never_replaced():
    model = Untraceable().eval()
    before = [p.clone() for p in model.parameters()]
    modifier = RoundingModifier()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipelineFallbackWarning)
        with pytest.raises(PipelineFailed, match="tracing failed"):
            run_pipeline(model, make_batches(), make_lifecycle(model, modifier), options(), requested="sequential")
    assert modifier.events == [] and modifier.rounded == []  # failed before any modifier saw data
    assert all(torch.equal(p, q) for p, q in zip(before, model.parameters()))


class _Boom:
    """A forward pre-hook raising ``exc`` on real (non-meta) data, as a kernel would."""

    def __init__(self, exc):
        self.exc = exc

    def __call__(self, module, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].device.type != "meta":
            raise self.exc


@pytest.mark.parametrize("exc", [torch.OutOfMemoryError("CUDA out of memory (simulated)"),
                                 MemoryError("simulated"), KeyboardInterrupt()], ids=type)
@pytest.mark.parametrize("requested", [None, "layer_sequential", "basic"])
def test_fatal_errors_propagate_and_hooks_are_removed(exc, requested):
    model = build_tiny_llama()
    handle = model.model.layers[1].mlp.register_forward_pre_hook(_Boom(exc))
    modifier = RoundingModifier()
    with warnings.catch_warnings():
        warnings.simplefilter("error", PipelineFallbackWarning)  # a fallback would be a swallowed error
        with pytest.raises(type(exc)):
            run_pipeline(model, make_batches(), make_lifecycle(model, modifier), options(), requested=requested)
    handle.remove()
    assert no_hooks_left(model, modifier)
    assert model.config.use_cache is True


def test_no_fallback_after_weights_were_changed():
    ran = []

    class HalfWay(Pipeline):
        name = "test-halfway"

        def run(self, model, batches, lifecycle, options):
            with lifecycle.calibrating():
                lifecycle.sequential_epoch_end(["model.layers.0"])
                raise PipelineFailed("gave up after layer 0")

    class Plugin:
        @hookimpl
        def layerwise_register_pipelines(self, register):
            register("test-halfway", HalfWay)

        @hookimpl
        def layerwise_select_pipeline(self, model, modifiers):
            ran.append("asked")
            return "test-halfway"

    host = get_host()
    host.register(Plugin(), name="test-halfway-plugin")
    try:
        model = build_tiny_llama()
        modifier = RoundingModifier()
        with pytest.raises(PipelineAborted, match="'test-halfway' failed after compressing"):
            run_pipeline(model, make_batches(), make_lifecycle(model, modifier), options())
    finally:
        host.unregister("test-halfway-plugin")
    assert ran == ["asked"]
    assert [e[0] for e in modifier.events] == ["calibration_start", "sequential_epoch_end"]  # nothing ran after
    assert no_hooks_left(model, modifier)


# -- layer_sequential refuses what is not a chain ----------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


class NotAChain(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block(), Block()])

    def forward(self, input_ids):
        x = self.blocks[0](self.embed(input_ids))
        return self.blocks[1](x * 2)  # something between the blocks


def test_layer_sequential_fails_cleanly_on_a_non_chain_and_basic_takes_over(monkeypatch):
    model = NotAChain()
    batches = [{"input_ids": torch.tensor([[1, 2, 3]])}]
    opts = PipelineOptions(sequential_targets=["Block"], show_progress=False)
    events = []

    @dataclass
    class Spy(Modifier):
        def on_calibration_start(self, state):
            events.append("start")

        def on_sequential_epoch_end(self, state, modules):
            events.append(tuple(modules))

    with pytest.raises(PipelineFailed, match="input of target 'blocks.1' is not the output of 'blocks.0'"):
        run_pipeline(model, batches, make_lifecycle(model, Spy()), opts, requested="layer_sequential")
    assert events == []  # refused before calibration started

    from layerwise.plugins.pipelines import pieces

    def untraceable(*a, **k):
        raise PipelineFailed("tracing failed: simulated")

    monkeypatch.setattr(pieces, "trace_for_pipeline", untraceable)
    with pytest.warns(PipelineFallbackWarning) as record:
        used = run_pipeline(model, batches, make_lifecycle(model, Spy()), opts)
    assert used == "basic"
    messages = [str(w.message) for w in record]
    assert any("'sequential'" in m and "simulated" in m for m in messages)
    assert any("'layer_sequential'" in m and "not a simple chain" in m for m in messages)


def test_fallbacks_are_recorded_whatever_the_warning_filters():
    from layerwise.host.pipeline_selection import recording_fallbacks

    model = Untraceable().eval()
    with warnings.catch_warnings(), recording_fallbacks() as outer, recording_fallbacks() as inner:
        warnings.simplefilter("ignore", PipelineFallbackWarning)
        run_pipeline(model, make_batches(), make_lifecycle(model, RoundingModifier()), options())
    assert len(inner) == 1 and inner == outer
    assert inner[0].startswith("pipeline 'sequential' cannot calibrate Untraceable, falling back to 'layer_sequential'")


@pytest.mark.filterwarnings("ignore:GPTQ. layer 'model.lm_head' is rounded to nearest")  # a wrapper's head sees no data
def test_compress_reports_the_fallbacks():
    import layerwise

    with pytest.warns(PipelineFallbackWarning):
        model = layerwise.compress(Untraceable().eval(), "GPTQ_W8A16", dataset=make_batches(), show_progress=False)
    report = model.layerwise_report
    assert report.pipeline == "layer_sequential"
    assert len(report.fallbacks) == 1 and "falling back to 'layer_sequential'" in report.fallbacks[0]
    assert report.guards_retraced == []


def test_a_fallback_caused_by_a_tensor_on_the_wrong_device_says_it_is_a_bug(monkeypatch):
    from layerwise.host.pipeline_selection import DeviceErrorFallbackWarning
    from layerwise.plugins.pipelines.sequential import SequentialPipeline
    from layerwise.runtime.devices import DeviceErrorWarning

    def wrong_device(self, model, batches, lifecycle, options):
        try:
            raise RuntimeError("Expected all tensors to be on the same device, but found at least two devices")
        except RuntimeError as exc:
            raise PipelineFailed(f"subgraph 0 failed to run: {exc}") from exc

    monkeypatch.setattr(SequentialPipeline, "run", wrong_device)
    model = build_tiny_llama()
    with pytest.warns(DeviceErrorFallbackWarning, match=r"falling back to 'layer_sequential'.*wrong device.*a bug"):
        assert run_pipeline(model, make_batches(), make_lifecycle(model, RoundingModifier()), options()) == \
            "layer_sequential"
    assert issubclass(DeviceErrorFallbackWarning, PipelineFallbackWarning)
    assert issubclass(DeviceErrorFallbackWarning, DeviceErrorWarning)
