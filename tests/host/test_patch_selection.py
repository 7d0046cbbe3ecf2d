"""Choosing a patch from a checkpoint's config.json alone, for the runs that build no model."""

from __future__ import annotations

from layerwise.host.model_patch import ModelPatch
from layerwise.host.patch_selection import find_patch_for_config

BY_TYPE = ModelPatch(name="by-type", model_types=("toy",))
BY_CLASS = ModelPatch(name="by-class", architectures=("ToyForCausalLM",))
PATCHES = [BY_TYPE, BY_CLASS]


def test_a_class_name_in_architectures_beats_the_model_type():
    config = {"architectures": ["ToyForCausalLM"], "model_type": "toy"}
    assert BY_CLASS.config_match_score(config) == 2 and BY_TYPE.config_match_score(config) == 1
    assert find_patch_for_config(config, PATCHES) is BY_CLASS
    assert find_patch_for_config({"architectures": "ToyForCausalLM"}, PATCHES) is BY_CLASS  # a bare string too


def test_the_model_type_alone_matches_and_nothing_else_does():
    assert find_patch_for_config({"architectures": ["Other"], "model_type": "toy"}, PATCHES) is BY_TYPE
    assert find_patch_for_config({"architectures": ["Other"], "model_type": "other"}, PATCHES) is None
    assert find_patch_for_config({}, PATCHES) is None


def test_the_registered_zoo_patch_matches_a_llama_checkpoint():
    assert find_patch_for_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).name == "llama"


def test_two_patches_matching_equally_are_warned_about_and_the_first_is_used():
    import pytest

    from layerwise.host.patch_selection import PatchTieWarning

    other = ModelPatch(name="another-by-class", architectures=("ToyForCausalLM",))
    with pytest.warns(PatchTieWarning, match="'by-class' .* 'another-by-class' .* match this model equally; using "
                                             "'by-class'"):
        assert find_patch_for_config({"architectures": ["ToyForCausalLM"]}, [BY_CLASS, other]) is BY_CLASS
