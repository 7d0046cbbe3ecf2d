"""General tracer mechanisms, one per test: pinned use_cache, structured opaque results,
output-capturing hooks, in-place mutation in wrapped statements, value-dependent helpers."""

from __future__ import annotations

import pytest
import torch
from blocks import two_blocks
from torch import nn

from layerwise.tracing import opaque, trace
from layerwise.tracing.meta import run_on_meta

TOL = 1e-6


# ---- use_cache reaches a submodule only through **kwargs -----------------------------------------
class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = two_blocks()
        self.calls: list = []

    def forward(self, x: torch.Tensor, use_cache: bool | None = None) -> torch.Tensor:
        self.calls.append(use_cache)
        for layer in self.layers:
            x = layer(x)
        return x


class KwargsOuter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()

    def forward(self, x: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.inner(x, **kwargs)


def test_use_cache_is_pinned_through_kwargs() -> None:
    model = KwargsOuter().eval()
    x = torch.randn(2, 3, 8)
    result = trace(model, {"x": x}, sequential_targets=["Block"])
    assert result.concrete_args == {"use_cache": False}
    assert model.inner.calls[-1] is False
    assert any("use_cache=False" in n and "Inner" in n for n in result.notes)
    assert result.verify({"x": x}) <= TOL


def test_use_cache_given_as_sample_input_is_kept() -> None:
    model = KwargsOuter().eval()
    result = trace(model, {"x": torch.randn(2, 3, 8), "use_cache": None}, sequential_targets=["Block"])
    assert result.concrete_args == {}


# ---- an opaque helper returning a dict ---------------------------------------------------------
def make_masks(x: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"plus": x + 1.0, "times": x * 2.0}


class DictUser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = two_blocks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        masks = make_masks(x)
        if not isinstance(masks, dict):  # what Gemma3's text model does with a mask mapping
            raise TypeError("expected the mask mapping")
        x = self.layers[0](masks["plus"])
        return self.layers[1](x) * masks["times"]


def test_opaque_function_returning_a_dict_stays_a_dict() -> None:
    model = DictUser().eval()
    x = torch.randn(2, 3, 8)
    result = trace(model, {"x": x}, sequential_targets=["Block"], opaque_functions=[make_masks])
    assert len(result.subgraphs) == 3
    assert [c.function.rsplit(".", 1)[-1] for c in result.opaque_calls] == ["make_masks"]
    assert any("make_masks returns a dict" in n for n in result.notes)
    assert result.verify({"x": x}) <= TOL


# ---- a wrapped statement that fills a dict in place ----------------------------------------------
def features(x: torch.Tensor) -> torch.Tensor:
    if x.sum() > 0:  # value-dependent: the statement calling it gets wrapped
        return x * 2
    return x


class FillsDict(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = two_blocks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outputs = {}
        outputs["image"] = features(x)
        x = self.layers[0](outputs["image"])
        return self.layers[1](x)


def test_wrapped_statement_keeps_its_dict_mutation() -> None:
    model = FillsDict().eval()
    x = torch.rand(2, 3, 8)
    result = trace(model, {"x": x}, sequential_targets=["Block"])
    assert [w.statement for w in result.wrapped] == ["outputs['image'] = features(x)"]
    assert len(result.subgraphs) == 3
    assert result.verify({"x": x}) <= TOL and result.verify({"x": -x}) <= TOL


# ---- a value-dependent helper made opaque with the decorator -------------------------------------
@opaque
def drop_empty_rows(x: torch.Tensor) -> torch.Tensor:
    return x[x.abs().sum(dim=(-1, -2)) != 0]


class DropsRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = two_blocks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = drop_empty_rows(x)
        for layer in self.layers:
            x = layer(x)
        return x.mean(dim=0)


def test_opaque_decorator_keeps_the_layers_traced() -> None:
    model = DropsRows().eval()
    x = torch.randn(3, 4, 8)
    result = trace(model, {"x": x}, sequential_targets=["Block"])
    assert len(result.subgraphs) == 3 and not result.wrapped
    assert [c.function.rsplit(".", 1)[-1] for c in result.opaque_calls] == ["drop_empty_rows"]
    padded = x.clone()
    padded[1] = 0  # one row dropped at replay
    assert result.verify({"x": padded}) <= TOL


def test_boolean_mask_indexing_keeps_every_row_on_meta() -> None:
    x = torch.empty(5, 3, device="meta")
    keep = torch.empty(5, dtype=torch.bool, device="meta")
    assert run_on_meta(lambda a, m: a[m], (x, keep), {}, real_weights=True).shape == (5, 3)


# ---- transformers' output-capturing hooks ------------------------------------------------------
def test_captured_hidden_states_come_from_the_graph() -> None:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    config = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=28, patch_size=14)
    model = CLIPVisionModel(config).eval()
    inputs = {"pixel_values": torch.randn(2, 3, 28, 28), "output_hidden_states": True}
    result = trace(model, inputs, sequential_targets=["CLIPEncoderLayer"])
    assert len(result.subgraphs) == 3
    assert not [n for n in result.graph_module.graph.nodes if n.op == "get_attr" and n.target.startswith("_lw_tensor")]
    assert any("output-capturing hooks on CLIPEncoderLayer" in n for n in result.notes)
    assert result.verify(inputs) <= 1e-5  # compares every hidden state too
    other = {"pixel_values": torch.randn(3, 3, 28, 28), "output_hidden_states": True}
    assert result.verify(other) <= 1e-5


@pytest.mark.parametrize("kind", ["tuple", "dict"])
def test_leaf_module_results_keep_their_structure(kind: str) -> None:
    class Pair(nn.Module):
        def forward(self, x):
            return (x + 1, x * 2) if kind == "tuple" else {"a": x + 1, "b": x * 2}

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pair = Pair()
            self.layers = two_blocks()

        def forward(self, x):
            out = self.pair(x)
            a, b = (out if kind == "tuple" else (out["a"], out["b"]))
            return self.layers[1](self.layers[0](a)) + b

    model = Model().eval()
    x = torch.randn(2, 8)
    result = trace(model, {"x": x}, sequential_targets=["Block"], leaf_modules=["Pair"])
    assert result.verify({"x": x}) <= TOL


# ---- targets the inputs never run ------------------------------------------------------------------
class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = two_blocks()
        self.text = two_blocks()

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        if image is not None:
            for layer in self.vision:
                image = layer(image)
            x = x + image
        for layer in self.text:
            x = layer(x)
        return x


def test_targets_not_run_by_the_inputs() -> None:
    from layerwise.tracing import SwallowedTargetsError

    x = {"x": torch.randn(2, 8)}
    with pytest.raises(SwallowedTargetsError, match="not run by these inputs") as info:
        trace(Towers(), x, sequential_targets=["Block"])
    assert "vision.0" in str(info.value) and "text.0" not in str(info.value)
    result = trace(Towers(), x, sequential_targets=["Block"], skip_uncalled_targets=True)
    assert result.target_names == ["text.0", "text.1"] and len(result.subgraphs) == 3
    assert any("left out: vision.0, vision.1" in n for n in result.notes)
    assert result.skipped_targets == ["vision.0", "vision.1"]
    both = trace(Towers(), {**x, "image": torch.randn(2, 8)}, sequential_targets=["Block"], skip_uncalled_targets=True)
    assert len(both.target_names) == 4 and not both.notes and not both.skipped_targets
