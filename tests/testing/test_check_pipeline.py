"""layerwise.testing.check_pipeline: the built-in pipelines pass it, and broken ones are caught by name."""

from __future__ import annotations

import pytest
import torch

from layerwise import hookimpl
from layerwise.host.pipeline import Pipeline
from layerwise.host.plugin_manager import registry
from layerwise.plugins.pipelines._common import all_module_names, calibration_mode
from layerwise.testing import PluginCheckError
from layerwise.testing.pipelines import check_pipeline


@pytest.mark.parametrize("name", [name for name, _ in registry("pipelines").items()])
def test_every_registered_pipeline_passes_the_kit(name):
    check_pipeline(name)


class FirstBatchOnly(Pipeline):
    """Calibrates on the first batch alone."""

    name = "kit-first-batch"

    def run(self, model, batches, lifecycle, options):
        with calibration_mode(model, lifecycle), lifecycle.calibrating():
            model(**batches[0])
            lifecycle.sequential_epoch_end(all_module_names(model))


class Swallower(Pipeline):
    """Hides a failing forward."""

    name = "kit-swallower"

    def run(self, model, batches, lifecycle, options):
        with calibration_mode(model, lifecycle), lifecycle.calibrating():
            for batch in batches:
                try:
                    model(**batch)
                except RuntimeError:
                    pass
            lifecycle.sequential_epoch_end(all_module_names(model))


class Scaler(Pipeline):
    """Edits a weight while moving data."""

    name = "kit-scaler"

    def run(self, model, batches, lifecycle, options):
        with calibration_mode(model, lifecycle), lifecycle.calibrating():
            for batch in batches:
                model(**batch)
            with torch.no_grad():
                model.model.norm.weight.mul_(2)
            lifecycle.sequential_epoch_end(all_module_names(model))


class BrokenPipelines:
    @hookimpl
    def layerwise_register_pipelines(self, register):
        for cls in (FirstBatchOnly, Swallower, Scaler):
            register(cls.name, cls)


@pytest.fixture
def broken(register_plugin):
    register_plugin(BrokenPipelines(), "kit-broken-pipelines")


@pytest.mark.parametrize("cls,message", [
    (FirstBatchOnly, r"check_pipeline\(kit-first-batch\): every sample: Linear inputs did not reach the modifier "
                     r"for every sample \(model.layers.0.self_attn.q_proj: 1 of 4"),
    (Swallower, r"check_pipeline\(kit-swallower\): errors propagate: compress\(\) succeeded although a forward "
                r"raised mid-calibration"),
    (Scaler, r"check_pipeline\(kit-scaler\): nothing changed: with a modifier that changes nothing, outputs moved"),
])
def test_a_broken_pipeline_is_caught_naming_the_step(broken, cls, message):
    with pytest.raises(PluginCheckError, match=message):
        check_pipeline(cls)


def test_an_unregistered_pipeline_is_caught():
    with pytest.raises(PluginCheckError, match=r"check_pipeline\(Scaler\): registered: .*not in the pipelines "
                                               r"registry"):
        check_pipeline(Scaler)
