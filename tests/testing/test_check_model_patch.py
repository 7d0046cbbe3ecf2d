"""layerwise.testing.check_model_patch: the zoo's patches pass it, and broken patches are caught by name."""

from __future__ import annotations

import dataclasses

import pytest

from layerwise.model_patch import find_patch
from layerwise.plugin_manager import registry
from layerwise.testing import PluginCheckError, check_model_patch
from tests.conftest import build_tiny_llama, skip_unless_verified
from tests.model_zoo.zoo_tiny_models import ARCHS

#: what the kit found in the zoo, left for their own fixes (found on transformers 5.24.0)
KNOWN = {
    "gemma3": "the saved W4A16 checkpoint does not reload: transformers' compressed-tensors load of Gemma3 "
              "fails with 'Linear' object has no attribute 'weight'",
    "mixtral": "the saved checkpoint reloads with outputs 0.11 off: the unfused experts do not map back onto "
               "transformers' fused Mixtral experts",
}


def patched(name):
    model = ARCHS[name].build()
    patch = find_patch(model, [p for _, p in registry("model_patches").items()])
    skip_unless_verified(patch)  # a patch is checked on the transformers releases it was verified on
    return patch, model


@pytest.mark.parametrize("name", list(ARCHS))
def test_every_zoo_patch_passes_the_kit(name, request):
    if name in KNOWN:
        request.applymarker(pytest.mark.xfail(reason=KNOWN[name], raises=PluginCheckError))
    patch, model = patched(name)
    check_model_patch(patch, model)


def test_the_llama_patch_passes_on_a_plain_llama():
    model = build_tiny_llama()
    check_model_patch(find_patch(model, [p for _, p in registry("model_patches").items()]), model)


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


def test_a_replay_that_differs_from_the_forward_is_caught_with_the_fix(monkeypatch):
    # the zoo's patches all replay exactly (qwen2_vl even without its opaque_functions: the tracer's
    # automatic wrapping covers them today), so the difference is injected where the check reads it
    from layerwise.tracing.result import TraceResult

    monkeypatch.setattr(TraceResult, "verify", lambda self, inputs: 0.02)
    patch, model = patched("qwen2_vl")
    with pytest.raises(PluginCheckError, match=r"check_model_patch\(qwen2_vl\): trace \(text\): the replay differs "
                                               r"from the plain forward by 0.02 .*opaque_functions"):
        check_model_patch(patch, model, calibrate=False)
