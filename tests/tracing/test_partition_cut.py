"""Cutting before targets (layers): pieces start with the layers that read one value."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerwise.tracing import trace
from layerwise.tracing.result import TraceError
from tests.conftest import build_tiny_llama


def _linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and n != "lm_head"]


def _sample(seed=0, length=12):
    ids = torch.randint(0, 128, (1, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_cut_before_groups_the_layers_reading_one_value_and_replays_exactly():
    model = build_tiny_llama()
    result = trace(model, _sample(), sequential_targets=_linears(model), cut="before")
    groups = [sub.target_names for sub in result.subgraphs]
    assert groups[0] == []  # embeddings and the first norm: what q/k/v read
    assert groups[1] == [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    assert groups[2] == ["model.layers.0.self_attn.o_proj"]
    assert groups[3] == ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    assert groups[4] == ["model.layers.0.mlp.down_proj"]
    assert len(result.subgraphs) == 4 * 2 + 1 and result.cut == "before"
    for sub in result.subgraphs:
        assert [e.module for e in sub.entries] == sub.target_names
        for entry in sub.entries:  # what an entry layer reads arrives from the previous piece
            assert set(entry.input_names) <= set(sub.input_names)
    # q/k/v read the very same value
    assert len({tuple(e.input_names) for e in result.subgraphs[1].entries}) == 1
    for seed in (0, 1):
        sample = _sample(seed)
        assert result.verify(sample) == 0.0


def test_entry_calls_bind_the_cached_values():
    model = build_tiny_llama()
    sample = _sample()
    result = trace(model, sample, sequential_targets=_linears(model), cut="before")
    values = dict(sample)
    values.update(result.subgraphs[0].run(values))
    entry = result.subgraphs[1].entries[0]
    args, kwargs = entry.bind(values)
    seen = []
    handle = model.model.layers[0].self_attn.q_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(**sample)
    handle.remove()
    assert kwargs == {} and torch.equal(args[0], seen[0])


class ScatterSum(nn.Module):
    """Sums two Linears into a buffer in place (as mixture-of-experts blocks do), then reads it."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        out = torch.zeros_like(x)
        out.index_add_(1, torch.arange(x.shape[1]), self.first(x))
        out.add_(self.second(x * 2))
        return self.head(out.relu())


@pytest.mark.parametrize("cut", ["after", "before"])
def test_in_place_effects_run_before_the_nodes_that_read_what_they_changed(cut):
    torch.manual_seed(0)
    model = ScatterSum().eval()
    sample = {"x": torch.randn(2, 5, 8)}
    result = trace(model, sample, sequential_targets=["first", "second", "head"], cut=cut)
    assert len(result.subgraphs) == 4  # three groups (first and second read different values)
    with torch.no_grad():
        assert result.verify(sample) < 1e-6


def test_cut_before_needs_one_call_per_target_and_one_target_per_group():
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x):
            return self.linear(self.linear(x))

    with pytest.raises(TraceError, match=r"one call per target.*linear \(2 calls\).*cut='after'"):
        trace(Twice(), {"x": torch.randn(1, 4)}, sequential_targets=["linear"], cut="before")
    model = build_tiny_llama()
    with pytest.raises(ValueError, match="targets_per_subgraph must be 1"):
        trace(model, _sample(), sequential_targets=_linears(model), cut="before", targets_per_subgraph=2)
    with pytest.raises(ValueError, match="cut must be one of"):
        trace(model, _sample(), cut="middle")
