"""``sequential`` cut at layers: one forward per piece, every layer fed by the model quantized so far.

The identities: where every piece holds one Linear, cutting at layers and at blocks is the
same computation, so GPTQ gives the same weights; every Linear's observed inputs equal its
inputs in a plain forward of the finished (quantized) model; and no piece runs twice for
one batch. The cut falls back to blocks, with its reason, wherever layers are not exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerwise.errors import InvalidArgumentError
from layerwise.host.modifier import Modifier
from layerwise.host.pipeline import PipelineOptions
from layerwise.host.plugin_manager import registry
from tests.conftest import build_tiny_llama
from tests.plugins.pipelines.helpers import RoundingModifier, make_batches, make_lifecycle


def gptq(**fields):
    fields.setdefault("scheme", "W4A16")
    fields.setdefault("strategy", "channel")
    return registry("modifiers").get("GPTQModifier")(**fields)


def run(model, *modifiers, batches=None, targets=("LlamaDecoderLayer",), **options):
    lifecycle = make_lifecycle(model, *modifiers, targets=targets)
    opts = PipelineOptions(sequential_targets=list(targets), show_progress=False, **options)
    registry("pipelines").get("sequential")().run(model, batches or make_batches(), lifecycle, opts)
    lifecycle.finalize()
    return lifecycle.state


class InputRecorder(Modifier):
    """Reads the inputs of every Linear in the decoder layers (as GPTQ does) and keeps copies."""

    requires_data = True

    def __post_init__(self) -> None:
        super().__post_init__()
        self.seen: dict[str, list[torch.Tensor]] = {}
        self.calibrating = False

    def names(self, model):
        return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in n]

    def on_calibration_start(self, state):
        self.calibrating = True
        for name in self.names(state.model):
            self.register_hook(state.model.get_submodule(name), self._record(name), "forward_pre")

    def on_calibration_end(self, state):
        self.calibrating = False

    def _record(self, name):
        def hook(module, args):
            self.seen.setdefault(name, []).append(args[0].detach().clone())
        return hook

    def calibration_inputs(self, modules):
        return {n for n in modules if ".layers." in n and n.rsplit(".", 1)[-1].endswith("proj")}


# -- identities ---------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x)) + x


class Stack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_with_one_linear_per_piece_layers_and_blocks_quantize_identically():
    torch.manual_seed(0)
    base = Stack()
    batches = [{"x": torch.randn(2, 40, 32)} for _ in range(3)]
    weights = {}
    for pieces in ("layers", "blocks"):
        model = Stack()
        model.load_state_dict(base.state_dict())
        state = run(model, gptq(scheme="W4A16", targets=["Linear"]), batches=batches, targets=("Block",),
                    pieces=pieces)
        assert state.pieces.startswith(f"{pieces}: "), state.pieces
        weights[pieces] = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert weights["layers"].keys() == weights["blocks"].keys()
    for name, value in weights["layers"].items():
        assert torch.equal(value, weights["blocks"][name]), name
    assert not torch.equal(weights["layers"]["blocks.0.linear.weight"], base.blocks[0].linear.weight)


def _true_inputs(model, batches, names):
    """Each Linear's inputs in a plain forward of ``model`` as it is now."""
    seen = {n: [] for n in names}
    handles = [model.get_submodule(n).register_forward_pre_hook(
        lambda m, a, n=n: seen[n].append(a[0].detach().clone())) for n in names]
    with torch.no_grad():
        for batch in batches:
            model(**batch, use_cache=False)
    for handle in handles:
        handle.remove()
    return seen


def test_every_linear_sees_the_inputs_of_the_model_quantized_so_far():
    batches = make_batches(lengths=(7, 9, 5))
    mismatched = {}
    for pieces in ("layers", "blocks"):
        model = build_tiny_llama()
        recorder = InputRecorder()
        state = run(model, gptq(ignore=["lm_head"]), recorder, batches=batches, pieces=pieces)
        assert state.pieces.startswith(pieces), state.pieces
        names = recorder.names(model)
        true = _true_inputs(model, batches, names)  # the finished model: every Linear quantized
        mismatched[pieces] = []
        for name in names:
            assert len(recorder.seen[name]) == len(batches), (pieces, name)
            if not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(recorder.seen[name], true[name])):
                mismatched[pieces].append(name)
    assert mismatched["layers"] == []
    # the check can fail: with whole blocks, o_proj, the MLP and down_proj saw full-precision inputs
    assert "model.layers.0.self_attn.o_proj" in mismatched["blocks"]
    assert "model.layers.0.self_attn.q_proj" not in mismatched["blocks"]


def _count_forwards(model, recorder):
    """Forward (post) hooks on every Linear and embedding: their forwards while calibration runs.

    (The traced graph inlines norms and activations; the layers it calls as modules are these.)
    """
    counts = {}

    def hook(name):
        def fn(module, args, output):
            if recorder.calibrating:
                counts[name] = counts.get(name, 0) + 1
        return fn

    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.register_forward_hook(hook(name))
    return counts


def test_no_piece_runs_more_than_once_per_batch():
    batches = make_batches(lengths=(7, 9, 5, 6))
    model = build_tiny_llama()
    recorder = InputRecorder()
    counts = _count_forwards(model, recorder)
    state = run(model, gptq(ignore=["lm_head"]), recorder, batches=batches)
    assert state.pieces.startswith("layers")
    assert counts and max(counts.values()) == len(batches)
    # the last piece (the last down_proj, the norm, lm_head) feeds nothing: it never runs
    layers = {n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    assert layers - set(counts) == {"model.layers.1.mlp.down_proj", "lm_head"}
    assert len(recorder.seen["model.layers.1.mlp.down_proj"]) == len(batches)  # observed from the cache

    # the counter can tell: with whole blocks the observed layers run twice
    blocks_model = build_tiny_llama()
    blocks_recorder = InputRecorder()
    blocks_counts = _count_forwards(blocks_model, blocks_recorder)
    run(blocks_model, gptq(ignore=["lm_head"]), blocks_recorder, batches=batches, pieces="blocks")
    assert blocks_counts["model.layers.0.self_attn.q_proj"] == 2 * len(batches)


def test_accounting_times_forwards_hessians_and_solves():
    model = build_tiny_llama()
    state = run(model, gptq(ignore=["lm_head"]))
    accounting = state.accounting
    assert {"forward", "GPTQ Hessians", "GPTQ solves"} <= set(accounting)
    # q/k/v and gate/up are solved stacked (one Hessian each): 4 solves per layer for 7 layers
    assert accounting["GPTQ solves"].calls == 8 and accounting["GPTQ solves"].flops > 0
    assert len(state.log) >= 14 and {r["method"] for r in state.log if "method" in r} == {"gptq"}
    # q/k/v and gate/up share one Gram matrix: 4 per layer, each over every token of the 3 batches
    from layerwise.runtime.accounting import gram_flops

    tokens = 7 + 9 + 5
    expected = 2 * (2 * gram_flops(tokens, 64, 128) + gram_flops(tokens, 64, 128) + gram_flops(tokens, 128, 128))
    assert accounting["GPTQ Hessians"].flops == expected


# -- where layers are not exact, blocks ---------------------------------------------------------
def test_a_modifier_needing_whole_forwards_keeps_blocks_and_says_why():
    state = run(build_tiny_llama(), RoundingModifier())
    assert state.pieces.startswith("blocks: ") and "RoundingModifier needs whole forwards" in state.pieces



@pytest.mark.parametrize("pieces, kept", [("blocks", True), ("layers", False)])
def test_only_the_blocks_cut_keeps_forward_temporaries_in_the_heap(monkeypatch, pieces, kept):
    # blocks run twice per batch: their temporaries stay in the C heap (layerwise.runtime.heap); the layer cut
    # gained nothing from it, so glibc's own thresholds stay there
    from layerwise.plugins.pipelines import sequential

    calls = []
    monkeypatch.setattr(sequential, "keep_temporaries_in_heap", lambda: calls.append(1) or True)
    state = run(build_tiny_llama(), gptq(ignore=["lm_head"]), pieces=pieces)
    assert state.pieces.startswith(pieces) and bool(calls) is kept

def test_without_error_propagation_blocks_run_once():
    state = run(build_tiny_llama(), gptq(ignore=["lm_head"]), propagate_error=False)
    assert state.pieces.startswith("blocks: ") and "runs once" in state.pieces and "propagate_error" in state.pieces


def test_layers_whose_replay_differs_from_the_model_are_not_used(monkeypatch):
    from layerwise.plugins.pipelines import pieces

    monkeypatch.setattr(pieces, "_difference_from_model", lambda *a: 0.25)
    state = run(build_tiny_llama(), gptq(ignore=["lm_head"]))
    assert state.pieces.startswith("blocks: ") and "0.25 (relative) away from the model" in state.pieces
    with pytest.raises(InvalidArgumentError, match="pieces='layers' cannot be used for this model"):
        run(build_tiny_llama(), gptq(ignore=["lm_head"]), pieces="layers")


def test_weights_elsewhere_compare_the_layers_with_the_blocks(monkeypatch):
    """A plain forward would load every weight at once: a streamed or offloaded model compares the two cuts."""
    from layerwise.plugins.pipelines import pieces

    monkeypatch.setattr(pieces, "resident", lambda *a: False)
    monkeypatch.setattr(pieces, "_first_batch_difference", lambda *a: 0.25)
    state = run(build_tiny_llama(), gptq(ignore=["lm_head"]))
    assert state.pieces.startswith("blocks: ") and "0.25 (relative) away from the block pieces" in state.pieces


def test_a_resident_model_cut_at_layers_is_traced_once(monkeypatch):
    """The block cut is traced only when it is needed: not when the layer cut matches the model."""
    from layerwise.plugins.pipelines import pieces

    cuts = []
    traced = pieces.trace_for_pipeline

    def counted(model, sample, options, lifecycle, layers=None):
        cuts.append("blocks" if layers is None else "layers")
        return traced(model, sample, options, lifecycle, layers)

    monkeypatch.setattr(pieces, "trace_for_pipeline", counted)
    state = run(build_tiny_llama(), gptq(ignore=["lm_head"]))
    assert state.pieces.startswith("layers: ") and cuts == ["layers"]


def test_asking_for_layers_where_they_cannot_be_used_is_an_error():
    with pytest.raises(InvalidArgumentError, match="RoundingModifier needs whole forwards.*pieces='auto'"):
        run(build_tiny_llama(), RoundingModifier(), pieces="layers")


def test_compress_reports_the_cut_and_refuses_an_unknown_one():
    import layerwise

    batches = make_batches(lengths=(16, 16))
    model = layerwise.compress(build_tiny_llama(), "GPTQModifier:\n  scheme: W4A16\n  strategy: channel\n",
                               dataset=batches, show_progress=False, device="cpu")
    report = model.layerwise_report
    assert report.pieces.startswith("layers: 9 pieces")
    assert report.accounting["GPTQ Hessians"]["gflops_per_second"] > 0
    with pytest.raises(InvalidArgumentError, match="unknown pieces 'layer'; did you mean 'layers'"):
        layerwise.compress(build_tiny_llama(), "W4A16", options=layerwise.CompressOptions.of(pieces="layer"), device="cpu")


def test_a_batch_lets_go_of_its_inputs_as_soon_as_its_piece_ran(monkeypatch):
    from layerwise.plugins.pipelines import sequential
    from layerwise.runtime.cache import IntermediatesCache

    early = []

    class Watched(IntermediatesCache):
        def free(self, names, batch=None):
            names = list(names)
            if batch is not None and batch + 1 < self.num_batches:
                waiting = set(names) & set(self.names(batch + 1))  # the next batch has not run yet
                super().free(names, batch)
                early.append((batch, bool(waiting), bool(set(names) & set(self.names(batch)))))
                return
            super().free(names, batch)

    monkeypatch.setattr(sequential, "IntermediatesCache", Watched)
    batches = make_batches(lengths=(7, 9, 5))
    run(build_tiny_llama(), gptq(ignore=["lm_head"]), batches=batches)
    assert early, "no per-batch free happened"
    # while batch i's inputs go, batch i+1 still holds its own (same names), and batch i holds none of them
    assert all(waiting and not left for _, waiting, left in early)
    assert {batch for batch, _, _ in early} == {0, 1}
