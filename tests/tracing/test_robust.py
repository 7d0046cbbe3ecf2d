"""Autowrap and robust mode, one behaviour per test, on small hand-written models."""

from __future__ import annotations

import functools

import pytest
import torch
from blocks import Block, two_blocks
from torch import nn

from layerwise.tracing import SwallowedTargetsError, TraceError, trace


class ReturnsOnValues(nn.Module):
    """Untraceable and not wrappable: a return inside value-dependent control flow."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x * 2
        return x - 1


class ClampsOnValues(nn.Module):
    """Wrappable: value-dependent statements that assign locals (and an assert)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 3
        if (y < 0).any():
            y = y.clamp(min=0) + 1
        assert torch.isfinite(y).all(), "non-finite input"
        return y - x


def doubled(fn):
    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        return fn(self, *args, **kwargs) * 2

    return wrapper


class DecoratedClamp(nn.Module):
    @doubled
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x < 0).any():
            x = x.abs()
        return x


class Toy(nn.Module):
    def __init__(self, pre: nn.Module) -> None:
        super().__init__()
        self.pre = pre
        self.layers = two_blocks()
        self.unused = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pre(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class GatedLayers(nn.Module):
    """A value-dependent statement that calls a target: autowrap would swallow it."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = two_blocks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x)
        if x.mean() > 0:
            x = self.layers[1](x)
        return x


class Outer(nn.Module):
    """A failing module that holds the targets: robust mode would swallow them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = two_blocks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        if x.sum() > 0:
            return x
        return -x


class Wrapper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = Outer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


TARGETS = ["Block"]


def _x(sign: float = 1.0, rows: int = 3) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"x": sign * (torch.rand(rows, 5, 8) + 0.1)}


def _check_replays(result, sign_inputs=(1.0, -1.0)) -> None:
    for sign in sign_inputs:
        assert result.verify(_x(sign)) <= 1e-6
        assert result.verify(_x(sign, rows=2)) <= 1e-6


def test_untraceable_module_becomes_leaf_with_message() -> None:
    model = Toy(ReturnsOnValues()).eval()
    result = trace(model, _x(), sequential_targets=TARGETS)
    assert list(result.failed_modules) == ["pre"]
    message = result.failed_modules["pre"]
    assert "data-dependent" in message and "return" in message
    assert "pre" in result.leaf_modules
    assert next(n.target for n in result.graph_module.graph.nodes if n.op == "call_module") == "pre"
    assert len(result.subgraphs) == 3
    _check_replays(result)  # the leaf runs the real code: both branches replay exactly


def test_not_robust_raises_naming_module_and_fix() -> None:
    with pytest.raises(TraceError, match=r"cannot trace 'pre'.*robust=True"):
        trace(Toy(ReturnsOnValues()), _x(), sequential_targets=TARGETS, robust=False)


def test_leaf_registration_is_per_trace_not_global() -> None:
    trace(Toy(ReturnsOnValues()), _x(), sequential_targets=TARGETS)
    assert ReturnsOnValues.forward.__code__.co_filename == __file__
    with pytest.raises(TraceError):  # a second trace does not inherit the first one's leaves
        trace(Toy(ReturnsOnValues()), _x(), sequential_targets=TARGETS, robust=False)


def test_unvisited_modules_are_reported() -> None:
    result = trace(Toy(Block()), _x(), sequential_targets=["re:layers\\.\\d+"])
    assert result.unvisited_modules == ["unused"]
    assert "pre" not in result.unvisited_modules and "pre.fc" not in result.unvisited_modules


def test_autowrap_records_statements_and_replays_both_branches() -> None:
    model = Toy(ClampsOnValues()).eval()
    result = trace(model, _x(), sequential_targets=TARGETS, robust=False)
    assert not result.failed_modules
    lines = {w.line: w for w in result.wrapped}
    assert len(lines) == 2
    statements = sorted(w.statement.splitlines()[0] for w in lines.values())
    assert statements == ["assert torch.isfinite(y).all(), 'non-finite input'", "if (y < 0).any():"]
    for rec in lines.values():
        assert rec.file == __file__ and rec.module == "pre"
        # the if-test reads tensor values; the assert reads y, an output of that wrapped if
        assert "data-dependent" in rec.why or "opaque call" in rec.why
    _check_replays(result)
    # the class itself is untouched: rewriting lives in the trace only
    assert ClampsOnValues.forward.__code__.co_filename == __file__


def test_autowrap_keeps_decorators() -> None:
    model = Toy(DecoratedClamp()).eval()
    result = trace(model, _x(), sequential_targets=TARGETS, robust=False)
    assert len(result.wrapped) == 1
    _check_replays(result)  # would differ by 2x if the decorator were dropped


def test_target_swallowed_by_wrapped_statement_is_an_error() -> None:
    with pytest.raises(SwallowedTargetsError) as info:
        trace(GatedLayers(), _x(), sequential_targets=TARGETS)
    message = str(info.value)
    assert "layers.1" in message and "if x.mean() > 0:" in message and "layers.0:" not in message


def test_target_swallowed_by_failed_module_is_an_error() -> None:
    with pytest.raises(SwallowedTargetsError) as info:
        trace(Wrapper(), _x(), sequential_targets=TARGETS)
    message = str(info.value)
    assert "body.layers.0" in message and "body.layers.1" in message
    assert "'body'" in message and "failed to trace" in message
