"""layerwise.testing.check_model_patch: the zoo's patches pass it, and broken patches are caught by name."""

from __future__ import annotations

import dataclasses
import textwrap
import types

import pytest
import torch

from layerwise.common.matching import unmatched
from layerwise.host.model_patch import ModelPatch
from layerwise.host.patch_selection import find_patch
from layerwise.host.plugin_manager import registry
from layerwise.testing import PluginCheckError, check_model_patch, patch_report
from tests.conftest import build_tiny_llama, skip_unless_verified
from tests.model_zoo.zoo_tiny_models import ARCHS

#: zoo patches the kit fails on today, with the reason (none on transformers 5.24.0)
KNOWN: dict[str, str] = {}


def patched(name):
    model = ARCHS[name].build()
    patch = find_patch(model, [p for _, p in registry("model_patches").items()])
    skip_unless_verified(patch)  # a patch is checked on the transformers releases it was verified on
    return patch, model


#: every installed patch's tiny models: what `layerwise plugins --check` runs (the zoo and the example alike)
TINY = [(patch, build) for _, patch in registry("model_patches").items() for build in patch.tiny_models]


@pytest.mark.parametrize("patch,build", TINY, ids=[f"{p.name}-{b.__name__}" for p, b in TINY])
def test_every_installed_patch_passes_the_kit_on_its_tiny_models(patch, build, request):
    if patch.name in KNOWN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN[patch.name], raises=PluginCheckError))
    skip_unless_verified(patch)  # a patch is checked on the transformers releases it was verified on
    check_model_patch(patch, build())


def test_a_patch_whose_targets_nest_is_caught():
    patch, model = patched("mixtral")
    nested = dataclasses.replace(patch, sequential_targets=(*patch.sequential_targets, "MixtralAttention"))
    with pytest.raises(PluginCheckError, match=r"check_model_patch\(mixtral\): targets: target "
                                               r"'model.layers.0.self_attn' is inside target 'model.layers.0'"):
        check_model_patch(nested, model)


def test_an_ignore_entry_matching_nothing_is_caught():
    patch, model = patched("qwen3_moe")
    typo = dataclasses.replace(patch, ignore=(*patch.ignore, "lm_haed"))
    with pytest.raises(PluginCheckError, match=r"ignore: ignore entry 'lm_haed' match no module"):
        check_model_patch(typo, model)


def first_token_scale(ids):
    """Reads a tensor value into Python: untraceable, so it must run opaquely."""
    return float(ids[0, 0].item() % 7 + 1)


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x)


class ScaledStack(torch.nn.Module):
    """Two blocks; the first one's call shares a statement with the untraceable helper."""

    def __init__(self):
        super().__init__()
        self.config = types.SimpleNamespace(vocab_size=50)
        self.embed = torch.nn.Embedding(50, 8)
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, input_ids, attention_mask=None):
        x = self.embed(input_ids)
        x = self.blocks[0](x) * first_token_scale(input_ids)
        return {"out": self.blocks[1](x)}


def stack_inputs(config, modality="text"):
    if modality != "text":
        raise ValueError("text only")
    ids = torch.randint(0, config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


STACK = ModelPatch(name="stack", sequential_targets=("Block",), sample_inputs=stack_inputs)


def test_a_patch_missing_an_opaque_function_is_caught_and_passes_with_it():
    torch.manual_seed(0)
    with pytest.raises(PluginCheckError, match=r"(?s)check_model_patch\(stack\): trace \(text\): tracing failed: "
                                               r"SwallowedTargetsError: .*blocks.0: swallowed .*first_token_scale"
                                               r".*Fix: call the untraceable function .*opaquely \(ModelPatch.opaque_functions\)"):
        check_model_patch(STACK, ScaledStack().eval(), calibrate=False)
    fixed = dataclasses.replace(STACK, opaque_functions=(first_token_scale,))
    check_model_patch(fixed, ScaledStack().eval(), calibrate=False)


def test_an_opaque_function_the_model_never_calls_is_caught():
    # a function of another module: e.g. one transformers moved, still listed under its old home
    stale = dataclasses.replace(STACK, opaque_functions=(first_token_scale, textwrap.dedent))
    with pytest.raises(PluginCheckError, match=r"opaque functions: textwrap.dedent is not a global of any module "
                                               r"that defines a layer of ScaledStack"):
        check_model_patch(stale, ScaledStack().eval(), calibrate=False)


def test_a_smoothing_mapping_matching_nothing_is_caught():
    model = build_tiny_llama()
    patch = find_patch(model, [p for _, p in registry("model_patches").items()])
    typo = dataclasses.replace(patch, smoothing_mappings=((("re:.*q_prj",), "re:.*input_layernorm"),))
    with pytest.raises(PluginCheckError, match=r"mappings: .*'re:.\*q_prj' match no module of LlamaForCausalLM"):
        check_model_patch(typo, model, calibrate=False)


def test_an_ignore_entry_another_layout_of_the_patch_uses_is_fine():
    # BERT's 'classifier' exists under BertForSequenceClassification only: checked on its tiny models
    patch = registry("model_patches").get("bert")
    model = patch.tiny_models[0]()
    assert unmatched(model, patch.ignore)  # the bare encoder has neither head
    check_model_patch(patch, model, calibrate=False)


def test_the_report_records_each_step_and_skips_what_builds_on_a_failure():
    model = build_tiny_llama()
    patch = find_patch(model, [p for _, p in registry("model_patches").items()])
    nested = dataclasses.replace(patch, sequential_targets=("LlamaDecoderLayer", "LlamaMLP"),
                                 ignore=(*patch.ignore, "lm_haed"))
    steps = {r.step: r for r in patch_report(nested, model)}
    assert [s for s, r in steps.items() if r.status == "failed"][:2] == ["ignore", "targets"]
    assert "lm_haed" in steps["ignore"].message and "LlamaMLP" not in steps["ignore"].message
    assert steps["mappings"].status == "passed"
    assert {steps[s].status for s in ("RTN", "GPTQ (text)", "reload")} == {"skipped"}


def test_a_replay_that_differs_from_the_forward_is_caught_with_the_fix(monkeypatch):
    # the zoo's patches all replay exactly (qwen2_vl even without its opaque_functions: the tracer's
    # automatic wrapping covers them today), so the difference is injected where the check reads it
    from layerwise.tracing.result import TraceResult

    monkeypatch.setattr(TraceResult, "verify", lambda self, inputs: 0.02)
    patch, model = patched("qwen2_vl")
    with pytest.raises(PluginCheckError, match=r"check_model_patch\(qwen2_vl\): trace \(text\): the replay differs "
                                               r"from the plain forward by 0.02 .*opaque_functions"):
        check_model_patch(patch, model, calibrate=False)


def test_a_smoothing_mapping_that_changes_the_model_is_caught():
    # Gemma's post_attention_layernorm normalises the attention output, not the MLP's input: smoothing
    # the MLP from it changes the model (the right norm is pre_feedforward_layernorm)
    patch = registry("model_patches").get("gemma3")
    wrong = dataclasses.replace(patch, smoothing_mappings=(
        (("re:.*gate_proj", "re:.*up_proj"), "re:.*post_attention_layernorm"),))
    with pytest.raises(PluginCheckError, match=r"mappings exact \(text\): scaling model.layers.0."
                                               r"post_attention_layernorm -> \['model.layers.0.mlp.gate_proj', "
                                               r"'model.layers.0.mlp.up_proj'\] changes the model's outputs"):
        check_model_patch(wrong, patch.tiny_models[1](), calibrate=False)


def test_a_rotation_layout_with_wrong_head_pairs_or_online_layers_is_caught():
    model = build_tiny_llama()
    patch = find_patch(model, [p for _, p in registry("model_patches").items()])
    wrong_heads = dataclasses.replace(patch, rotation_layout=dataclasses.replace(
        patch.rotation_layout, heads=("re:.*self_attn\\.k_proj$", "re:.*self_attn\\.o_proj$")))
    with pytest.raises(PluginCheckError, match=r"rotation exact \(text\): rotating the residual stream .* moves"):
        check_model_patch(wrong_heads, model, calibrate=False)
    not_linear = dataclasses.replace(patch, rotation_layout=dataclasses.replace(
        patch.rotation_layout, online=("re:.*\\.mlp$",)))
    with pytest.raises(PluginCheckError, match=r"rotation exact \(text\): .*nn.Linear layers only"):
        check_model_patch(not_linear, model, calibrate=False)
    wrong_signs = dataclasses.replace(patch, rotation_layout=dataclasses.replace(  # signs through the activation
        patch.rotation_layout, online_signs=("re:.*mlp\\.gate_proj$", "re:.*mlp\\.down_proj$")))
    with pytest.raises(PluginCheckError, match=r"rotation exact \(text\): rotating the residual stream .* moves"):
        check_model_patch(wrong_signs, model, calibrate=False)
