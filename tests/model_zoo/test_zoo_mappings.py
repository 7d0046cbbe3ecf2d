"""Every zoo patch's smoothing mappings: one per block at least, and exact on its own tiny models.

Smoothing a mapping with any positive scales must leave the model's outputs unchanged: a missing
reader of the smoothed output, a norm that is not an input norm (Gemma's post_attention_layernorm)
or a post-LN norm (BERT's, the residual stream itself) shows up as a changed output here.
"""

from __future__ import annotations

import importlib
import pkgutil
import warnings

import pytest
import torch

import layerwise
import layerwise.model_zoo
from layerwise.algorithms.quantization.mappings import resolve_mappings
from layerwise.algorithms.quantization.smoothing import apply_smoothing
from layerwise.algorithms.quantization.storage import linear_weight
from layerwise.common.matching import find_modules, is_linear_like, matches
from layerwise.host.model_patch import ModelPatch
from layerwise.host.patch_selection import apply_patch
from layerwise.plugins.modifiers.smoothquant import SmoothQuantModifier, SmoothQuantWarning
from tests.conftest import skip_unless_verified

MODALITIES = ("text", "image", "audio")


def _zoo_patches() -> list[ModelPatch]:
    found: dict[str, ModelPatch] = {}
    for info in pkgutil.iter_modules(layerwise.model_zoo.__path__):
        module = importlib.import_module(f"layerwise.model_zoo.{info.name}")
        found.update({v.name: v for v in vars(module).values() if isinstance(v, ModelPatch)})
    return [found[name] for name in sorted(found)]


CASES = [pytest.param(patch, build, id=build.__name__) for patch in _zoo_patches() for build in patch.tiny_models]


def _built(patch: ModelPatch, build):
    skip_unless_verified(patch)
    model = build()
    apply_patch(model, patch)
    return model


def _blocks_with_quantized_layers(model: torch.nn.Module, patch: ModelPatch) -> list[str]:
    """The outermost sequential targets holding a Linear the patch does not ignore (the ones worth smoothing)."""
    blocks: list[str] = []
    for name, block in find_modules(model, patch.sequential_targets).items():
        if any(name.startswith(outer + ".") for outer in blocks):
            continue
        if any(is_linear_like(m) and not matches(f"{name}.{n}", m, patch.ignore) for n, m in block.named_modules()):
            blocks.append(name)
    return blocks


@pytest.mark.parametrize("patch, build", CASES)
def test_every_block_has_a_mapping(patch, build):
    model = _built(patch, build)
    resolution = resolve_mappings(model, patch.smoothing_mappings, owner="test", patch_name=patch.name)
    smoothed = [m.smoothed for m in resolution.mappings]
    blocks = _blocks_with_quantized_layers(model, patch)
    assert blocks
    bare = [b for b in blocks if not any(s.startswith(b + ".") for s in smoothed)]
    assert not bare, f"blocks without a smoothing mapping: {bare}"


def _tensors(value) -> list[torch.Tensor]:
    """Every tensor of a model output (ModelOutput, tuple, dict), caches left out."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _outputs(model: torch.nn.Module, inputs: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        return [t.clone() for t in _tensors(model(**inputs))]


@pytest.mark.parametrize("patch, build", CASES)
def test_smoothing_every_mapping_keeps_the_outputs(patch, build):
    model = _built(patch, build)
    samples = {}
    for modality in MODALITIES:
        try:
            samples[modality] = patch.sample_inputs(model.config, modality)
        except ValueError:
            continue
    assert samples
    expected = {modality: _outputs(model, inputs) for modality, inputs in samples.items()}
    resolution = resolve_mappings(model, patch.smoothing_mappings, owner="test", patch_name=patch.name)
    generator = torch.Generator().manual_seed(0)
    for mapping in resolution.mappings:
        width = linear_weight(model.get_submodule(mapping.balance[0])).shape[1]
        apply_smoothing(model, mapping, torch.rand(width, generator=generator) * 3.9 + 0.1)
    for modality, inputs in samples.items():
        got = _outputs(model, inputs)
        assert len(got) == len(expected[modality])
        for a, b in zip(got, expected[modality]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, where=modality: f"{where}: {m}")


@pytest.mark.parametrize("patch, build", CASES)
def test_smoothquant_smooths_every_mapping_through_the_sequential_pipeline(patch, build):
    # the richest input the patch takes runs every tower, so every mapping sees data and is smoothed
    # at the end of its own block, which then re-runs from its input: the outputs stay what they were
    model = _built(patch, build)
    modality = next(m for m in ("image", "audio", "text") if _takes(patch, model, m))
    batch = patch.sample_inputs(model.config, modality)
    expected = _outputs(model, batch)
    resolved = resolve_mappings(model, patch.smoothing_mappings, owner="test", patch_name=patch.name).mappings
    modifier = SmoothQuantModifier()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SmoothQuantWarning)
        layerwise.compress(model, modifier, dataset=[batch], show_progress=False, options=layerwise.CompressOptions.of(pipeline="sequential", patch=patch))
    assert set(modifier.scales) == {m.smoothed for m in resolved}
    for a, b in zip(_outputs(model, batch), expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _takes(patch: ModelPatch, model: torch.nn.Module, modality: str) -> bool:
    try:
        patch.sample_inputs(model.config, modality)
    except ValueError:
        return False
    return True
