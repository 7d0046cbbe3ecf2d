"""Guards: a traced graph never runs a batch that breaks a decision it was built on."""

from __future__ import annotations

import warnings

import pytest
import torch
from blocks import two_blocks
from torch import nn

from layerwise.tracing import GuardViolation, opaque, trace
from layerwise.tracing.kinds import ANY, TENSOR, TENSOR_OR_NONE, kind_of, matches
from layerwise.tracing.retrace import TracesByGuards

TOL = 1e-6


# ---- an opaque helper that returns None for some batches and a tensor for others ----------------
@opaque
def padding_bias(mask: torch.Tensor) -> torch.Tensor | None:
    """None when nothing is padded (the common fast path of transformers' mask builders)."""
    if bool(mask.all()):
        return None
    return (1.0 - mask.float())[..., None] * -3.0


class MaskedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = two_blocks()

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        bias = padding_bias(mask)
        h = self.layers[0](x)
        if bias is not None:  # decided while tracing: `is` cannot be traced
            h = h + bias
        return self.layers[1](h)


def _model() -> MaskedNet:
    torch.manual_seed(0)
    return MaskedNet().eval()


FULL = {"x": torch.randn(2, 5, 8), "mask": torch.ones(2, 5)}
PADDED = {"x": torch.randn(2, 5, 8), "mask": torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2])}


def _replays_like_the_model(model: nn.Module, result, batch) -> bool:
    with torch.no_grad():
        return torch.allclose(result.replay(batch), model(**batch), atol=TOL)


def test_an_opaque_result_is_a_guard_with_its_source_line() -> None:
    model = _model()
    result = trace(model, PADDED, sequential_targets=["Block"])
    (guard,) = [g for g in result.guards if g.kind == "result"]
    assert guard.how == "padding_bias" and guard.expected == TENSOR  # `h + bias` reads it: strict
    assert guard.source.endswith(f"test_guards.py:{MaskedNet.forward.__code__.co_firstlineno + 1}")
    assert _replays_like_the_model(model, result, PADDED)
    with pytest.raises(GuardViolation, match=r"padding_bias\(\.\.\.\) returned Tensor .* got None"):
        result.replay(FULL)


def test_trace_learns_what_its_own_sample_gives() -> None:
    # on meta, `mask.all()` cannot be answered, so the helper looks like it returns a tensor;
    # the real sample returns None: trace() re-traces until its graph holds for its sample
    model = _model()
    result = trace(model, FULL, sequential_targets=["Block"])
    (guard,) = [g for g in result.guards if g.kind == "result"]
    assert guard.expected == "None"
    assert _replays_like_the_model(model, result, FULL)
    with pytest.raises(GuardViolation, match="returned None .* got Tensor"):  # the mirror case: never dropped
        result.replay(PADDED)


@pytest.mark.parametrize("order", [(FULL, PADDED, FULL), (PADDED, FULL, PADDED)], ids=["none-first", "tensor-first"])
def test_each_kind_of_batch_gets_its_own_trace_in_either_order(order) -> None:
    model = _model()
    traces = TracesByGuards(lambda sample: trace(model, sample, sequential_targets=["Block"]))
    assignment = [traces.for_batch(batch, f"batch {i}") for i, batch in enumerate(order)]
    assert assignment == [0, 1, 0] and len(traces.traces) == 2
    assert len(traces.retraced) == 1 and "padding_bias" in traces.retraced[0] and "batch 1" in traces.retraced[0]
    for index, batch in zip(assignment, order):
        assert _replays_like_the_model(model, traces.traces[index], batch)


def test_a_guard_behind_a_target_is_checked_where_it_runs() -> None:
    class Late(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = two_blocks()

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            h = self.layers[0](x)
            bias = padding_bias(mask * (h[..., 0] * 0 + 1))  # depends on a target's output
            if bias is not None:
                h = h + bias
            return self.layers[1](h)

    torch.manual_seed(0)
    model = Late().eval()
    result = trace(model, PADDED, sequential_targets=["Block"])
    assert result.guard_violation(FULL) is None  # not checkable before the batch runs ...
    with pytest.raises(GuardViolation, match="padding_bias"):  # ... so the graph checks it in place
        result.replay(FULL)


# ---- a branch on the sequence length -----------------------------------------------------------
class LengthBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = two_blocks()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] > 8:  # long inputs are scaled down
            x = x * 0.5
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_length_branch_is_a_value_guard_checked_at_another_length() -> None:
    torch.manual_seed(0)
    model = LengthBranch().eval()
    short, long = {"x": torch.randn(2, 6, 8)}, {"x": torch.randn(2, 12, 8)}
    result = trace(model, short, sequential_targets=["Block"])
    (guard,) = result.guards
    assert guard.kind == "value" and guard.how == "bool" and guard.expected is False
    assert guard.source.endswith(f"test_guards.py:{LengthBranch.forward.__code__.co_firstlineno + 1}")
    assert result.verify({"x": torch.randn(3, 7, 8)}) <= TOL  # another batch and length, same decision
    with pytest.raises(GuardViolation, match=r"bool\(.*\) was False while tracing .* got True"):
        result.verify(long)

    traces = TracesByGuards(lambda sample: trace(model, sample, sequential_targets=["Block"]))
    assert [traces.for_batch(b) for b in (short, long, short, long)] == [0, 1, 0, 1]
    assert _replays_like_the_model(model, traces.traces[1], long)


def test_a_decision_on_a_stubbed_value_is_wrapped_not_baked() -> None:
    class ItemBranch(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = two_blocks()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.mean().item() > 0:  # meta answers .item() with a stand-in 0: never decide on it
                x = x * 2
            return self.layers[1](self.layers[0](x))

    torch.manual_seed(0)
    model = ItemBranch().eval()
    x = torch.randn(2, 4, 8).abs()
    result = trace(model, {"x": x}, sequential_targets=["Block"])
    assert [w.statement.splitlines()[0] for w in result.wrapped] == ["if x.mean().item() > 0:"]
    assert result.verify({"x": x}) <= TOL and result.verify({"x": -x}) <= TOL


def test_kinds_and_loose_patterns() -> None:
    assert kind_of((torch.ones(1), None)) == ("tuple", (TENSOR, "None"))
    assert matches(("dict", (("a", TENSOR_OR_NONE), ("b", ANY))), {"a": None, "b": 3})
    assert not matches(("dict", (("a", TENSOR),)), {"a": None})
    assert not matches(("tuple", (TENSOR,)), (torch.ones(1), torch.ones(1)))


def test_a_mask_only_kernels_read_may_be_none_or_a_tensor() -> None:
    """The sdpa case: the mask flows only into an opaque kernel, which tests it itself."""

    @opaque
    def kernel(h: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return h if bias is None else h + bias

    class KernelNet(MaskedNet):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            return self.layers[1](kernel(self.layers[0](x), padding_bias(mask)))

    torch.manual_seed(0)
    model = KernelNet().eval()
    result = trace(model, PADDED, sequential_targets=["Block"])
    guard = next(g for g in result.guards if g.how == "padding_bias")
    assert guard.expected == TENSOR_OR_NONE
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _replays_like_the_model(model, result, FULL) and _replays_like_the_model(model, result, PADDED)


def test_a_none_item_of_an_opaque_tuple_stays_strict() -> None:
    """The code was handed ``None`` for the bias and skipped it: a batch with a bias must not pass."""

    @opaque
    def scale_and_bias(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        scale = mask.float()[..., None]
        return scale, (None if bool(mask.all()) else scale * -3.0)

    class TupleNet(MaskedNet):
        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            scale, bias = scale_and_bias(mask)
            h = self.layers[0](x) * scale
            if bias is not None:
                h = h + bias
            return self.layers[1](h)

    torch.manual_seed(0)
    model = TupleNet().eval()
    result = trace(model, FULL, sequential_targets=["Block"])
    guard = next(g for g in result.guards if g.how == "scale_and_bias")
    assert guard.expected == ("tuple", (TENSOR, "None"))
    assert _replays_like_the_model(model, result, FULL)
    with pytest.raises(GuardViolation, match=r"returned tuple\(Tensor, None\) .* got tuple\(Tensor, Tensor\)"):
        result.replay(PADDED)


def test_a_shape_guard_meta_cannot_answer_is_asked_of_the_real_batch() -> None:
    class MetaShy(nn.Module):
        """Runs on meta for short inputs only (as some kernels lack meta support for some shapes)."""

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.is_meta and x.shape[1] > 8:
                raise RuntimeError("no meta kernel for this shape")
            return x * 1.0

    class Net(LengthBranch):
        def __init__(self) -> None:
            super().__init__()
            self.shy = MetaShy()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(self.shy(x))

    torch.manual_seed(0)
    model = Net().eval()
    result = trace(model, {"x": torch.randn(2, 6, 8)}, sequential_targets=["Block"], leaf_modules=["MetaShy"])
    with pytest.raises(GuardViolation, match="got True"):  # never silently the short-input branch
        result.replay({"x": torch.randn(2, 12, 8)})


class RankBranch(nn.Module):
    """Decides on the rank of a shape only (``len(x.shape[:-1])``), as BERT's attention does."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(8, 8)

    def forward(self, x):
        lead = x.shape[:-1]
        if len(lead) == 2:
            x = x * 2
        return self.block(x)


def test_shape_guards_that_read_only_ranks_are_checked_once_per_rank(monkeypatch) -> None:
    from layerwise.tracing import guards

    model = RankBranch().eval()
    result = trace(model, {"x": torch.randn(2, 5, 8)}, sequential_targets=["block"])
    (guard,) = result.guards
    assert guard.how == "len" and result.guard_program.rank_only
    runs = []
    real_run = guards._run
    monkeypatch.setattr(guards, "_run", lambda *a, **k: runs.append(1) or real_run(*a, **k))
    for length in (3, 7, 9, 12):  # other lengths, same rank: the check trace() made answers them all
        assert result.guard_violation({"x": torch.randn(2, length, 8)}) is None
    assert runs == []
    broken = result.guard_violation({"x": torch.randn(5, 8)})  # another rank: checked, and broken
    assert broken is not None and broken[0] is guard and len(runs) == 1
    # a guard on a size keeps one check per shape
    sized = trace(LengthBranch().eval(), {"x": torch.randn(2, 6, 8)}, sequential_targets=["Block"])
    assert not sized.guard_program.rank_only
