"""``trace()`` resolves and applies the model patch exactly as ``compress()`` does."""

from __future__ import annotations

import models
import pytest
from transformers.models.llama import modeling_llama

from layerwise import ModelPatch
from layerwise.errors import UnknownNameError
from layerwise.tracing import trace


def test_the_registered_patch_is_found_and_used_by_default() -> None:
    model = models.build("BertModel")
    result = trace(model, models.sample_inputs(model))
    assert result.patch is not None and result.patch.name == "bert"
    assert result.target_names == ["encoder.layer.0", "encoder.layer.1"]  # BertLayer: the patch's targets
    assert model._layerwise_patch is result.patch  # applied, as compress() applies it
    assert "pooler" in result.leaf_modules  # the patch's ignore list: the pooler stays one call
    assert result.verify(models.sample_inputs(model)) <= 1e-5


def test_patch_false_traces_the_model_as_transformers_declares_it() -> None:
    model = models.build("BertModel")
    result = trace(model, models.sample_inputs(model), patch=False)
    assert result.patch is None
    assert result.target_names == ["embeddings", "encoder.layer.0", "encoder.layer.1"]  # _no_split_modules


def test_a_patch_by_name_or_object_brings_targets_ignore_opaque_functions_and_leaves() -> None:
    model = models.build("LlamaForCausalLM")
    inputs = models.sample_inputs(model)
    by_name = trace(model, inputs, patch="llama")
    assert by_name.patch.name == "llama" and len(by_name.target_names) == 2

    custom = ModelPatch(name="custom", sequential_targets=("re:model\\.layers\\.1",),
                        ignore=("re:model\\.layers\\.0\\.mlp",), leaf_modules=("LlamaRotaryEmbedding",),
                        opaque_functions=(modeling_llama.apply_rotary_pos_emb,))
    model = models.build("LlamaForCausalLM")
    result = trace(model, inputs, patch=custom)
    assert result.target_names == ["model.layers.1"]  # layer 0 is traced through: its code is in the graph
    assert {"model.rotary_emb", "model.layers.0.mlp"} <= set(result.leaf_modules)
    assert any(c.function.endswith("apply_rotary_pos_emb") for c in result.opaque_calls)
    assert result.verify(inputs) <= 1e-5
    # arguments still win over the patch, as in compress()
    assert trace(model, inputs, patch=custom, sequential_targets=["LlamaDecoderLayer"]).target_names == [
        "model.layers.0", "model.layers.1"]


def test_an_unknown_patch_name_lists_the_registered_ones() -> None:
    model = models.build("LlamaForCausalLM")
    with pytest.raises(UnknownNameError, match="unknown model patch 'lama'.*llama"):
        trace(model, models.sample_inputs(model), patch="lama")


def test_compress_and_trace_cut_the_same_model_the_same_way() -> None:
    from layerwise.verbs.compression import compress

    model = models.build("BertModel")
    inputs = models.sample_inputs(model)
    compress(model, "W8A16", show_progress=False)  # data-free: picks and applies the patch
    through_compress = model.layerwise_report.sequential_targets
    result = trace(model, inputs)
    assert through_compress == list(result.patch.sequential_targets) == ["BertLayer"]
