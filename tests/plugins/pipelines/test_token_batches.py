"""Short samples joined along the token axis in the pieces that never mix tokens.

The identities: a piece is joined only where two samples joined give what they give one by one
(checked by running it, never guessed); a piece that mixes tokens, or whose values are not all
per token, is never joined; and calibrating with joined forwards gives the weights calibrating
one sample at a time gives (up to the rounding of differently shaped products).
"""

from __future__ import annotations

import torch
from torch import nn

from layerwise.host.pipeline import PipelineOptions
from layerwise.host.plugin_manager import registry
from layerwise.plugins.pipelines import sequential
from layerwise.plugins.pipelines.token_batches import (
    JOIN_BELOW,
    TokenBatcher,
    join,
    split,
    token_count,
    token_wise_pieces,
)
from layerwise.tracing import trace
from tests.conftest import build_tiny_llama
from tests.plugins.pipelines.helpers import make_batches, make_lifecycle


def linear_names(model):
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]


def test_values_join_and_split_along_the_token_axis():
    a = {"h": torch.randn(1, 3, 4), "flag": True}
    b = {"h": torch.randn(1, 5, 4), "flag": True}
    assert token_count(a) == 3 and token_count({"h": torch.ones(1, 3, 4), "mask": torch.ones(1, 1, 3, 3)}) is None
    assert token_count({"h": torch.ones(2, 3, 4)}) is None and token_count({"h": torch.ones(1, 3), "x": [1]}) is None
    assert token_count({"h": torch.ones(1, 3, 4), "ids": torch.ones(1, 4)}) is None  # two token counts
    joined = join([a, b])
    assert joined["h"].shape == (1, 8, 4) and joined["flag"] is True
    back = split({"h": joined["h"] * 2}, [3, 5])
    assert torch.equal(back[0]["h"], a["h"] * 2) and torch.equal(back[1]["h"], b["h"] * 2)
    assert back[0]["h"].untyped_storage().nbytes() == back[0]["h"].nbytes  # owns its memory
    assert split({"pooled": joined["h"].mean(1)}, [3, 5]) is None


def test_llama_pieces_after_attention_are_token_wise_and_attention_is_not():
    model = build_tiny_llama()
    first, second = make_batches(lengths=(7, 9))[:2]
    traced = trace(model, first, sequential_targets=linear_names(model), cut="before", skip_uncalled_targets=True)
    found = token_wise_pieces(traced.subgraphs, first, second, None)
    starts = {sub.index: sub.target_names[0].rsplit(".", 1)[-1] if sub.target_names else "head"
              for sub in traced.subgraphs}
    # the embedding lookup is per token too; the pieces starting at q/k/v hold the attention (and the head
    # passes no mask: the causal mask and rotary tables are made in the first attention piece)
    assert {starts[i] for i in found} == {"head", "o_proj", "gate_proj", "down_proj"}
    attention = [i for i, name in starts.items() if name == "q_proj"]
    assert attention and not set(attention) & found
    assert traced.subgraphs[-1].index not in found  # the last piece feeds nothing: never checked


class TokenMixer(nn.Module):
    """Per-token layers around a running sum over the tokens: (1, T, H) in and out, but not token-wise."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.a(x).cumsum(dim=1))))


def test_a_piece_mixing_tokens_is_found_out_by_running_it():
    model = TokenMixer()
    first, second = {"x": torch.randn(1, 5, 8)}, {"x": torch.randn(1, 6, 8)}
    traced = trace(model, first, sequential_targets=["a", "b", "c"], cut="before", skip_uncalled_targets=True)
    found = token_wise_pieces(traced.subgraphs, first, second, None)
    starts = {sub.index: sub.target_names[0] if sub.target_names else "" for sub in traced.subgraphs}
    assert {starts[i] for i in found} == {"b"}  # a's piece holds the cumsum; c's is the last


def test_long_samples_are_never_joined():
    model = TokenMixer()
    long = {"x": torch.randn(1, JOIN_BELOW, 8)}
    traced = trace(model, long, sequential_targets=["a", "b", "c"], cut="before", skip_uncalled_targets=True)
    assert token_wise_pieces(traced.subgraphs, long, long, None) == set()
    batcher = TokenBatcher({sub.index for sub in traced.subgraphs})
    sub = traced.subgraphs[1]
    values = {0: {name: torch.randn(1, 4, 8) for name in sub.input_names},
              1: {name: torch.randn(1, JOIN_BELOW, 8) for name in sub.input_names},
              2: {name: torch.randn(1, 4, 8) for name in sub.input_names},
              3: {name: torch.randn(1, 4, 8) for name in sub.input_names}}
    groups = [g for g, _ in batcher.groups([0, 1, 2, 3], lambda i: sub, values.__getitem__)]
    assert groups == [[0], [1], [2, 3]]


def _calibrate(model, batches, **options):
    gptq = registry("modifiers").get("GPTQModifier")(scheme="W4A16", strategy="channel")
    lifecycle = make_lifecycle(model, gptq, targets=("LlamaDecoderLayer",))
    options = PipelineOptions(sequential_targets=["LlamaDecoderLayer"], show_progress=False, **options)
    registry("pipelines").get("sequential")().run(model, batches, lifecycle, options)
    lifecycle.finalize()
    assert lifecycle.state.pieces.startswith("layers")
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}


def test_joined_forwards_calibrate_as_one_sample_at_a_time(monkeypatch):
    batches = make_batches(lengths=(7, 9, 5, 6, 8, 4))
    calls = []
    real_run = TokenBatcher.run

    def counting(self, sub, samples):
        calls.append(len(samples))
        return real_run(self, sub, samples)

    monkeypatch.setattr(TokenBatcher, "run", counting)
    joined = _calibrate(build_tiny_llama(), batches)
    assert max(calls) == len(batches)  # token-wise pieces took every sample in one call
    monkeypatch.setattr(sequential, "token_wise_pieces", lambda *args: set())
    calls.clear()
    alone = _calibrate(build_tiny_llama(), batches)
    assert max(calls) == 1
    for name, weight in alone.items():
        differs = (joined[name] != weight).float().mean().item()
        assert differs <= 0.01, name  # a product's rounding may tip a rare weight to its neighbour
        step = weight.abs().max().item() / 7
        assert (joined[name] - weight).abs().max().item() <= step * 1.01, name


def test_joined_outputs_go_to_a_disk_cache_as_each_samples_own_tensors(monkeypatch):
    """A disk cache saves each sample's values on their own: joined outputs are split into copies (a view
    would save the whole joined tensor with every sample)."""
    batches = make_batches(lengths=(7, 9, 5))
    saved = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda value, path, *a, **k: saved.append(value) or real_save(value, path))
    joined = _calibrate(build_tiny_llama(), batches, offload="disk")
    assert saved and all(t.untyped_storage().nbytes() == t.nbytes for v in saved if isinstance(v, torch.Tensor)
                         for t in [v])
    monkeypatch.setattr(sequential, "token_wise_pieces", lambda *args: set())
    alone = _calibrate(build_tiny_llama(), batches, offload="disk")
    for name in joined:
        assert (joined[name] != alone[name]).float().mean().item() <= 0.01, name
