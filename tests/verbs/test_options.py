"""CompressOptions: frozen groups checked when made, one object for compress(), the CLI, the summary and resume."""

import dataclasses
import inspect

import pytest

import layerwise
from layerwise.errors import DatasetError, InvalidArgumentError
from layerwise.verbs.compression import FlatOptionWarning
from layerwise.verbs.options import CalibrationOptions, CompressOptions, PlacementOptions
from tests.conftest import build_tiny_llama


def test_compress_has_the_everyday_arguments_and_one_options_object():
    parameters = inspect.signature(layerwise.compress).parameters
    assert len(parameters) <= 10
    assert list(parameters)[:3] == ["model", "recipe", "dataset"] and "options" in parameters


def test_flat_settings_are_routed_to_their_groups_and_frozen():
    options = CompressOptions.of(pieces="layers", weights="stream", save_format="compressed-tensors",
                                 non_finite="skip", ignore=["lm_head"])
    assert options.calibration.pieces == "layers" and options.calibration.ignore == ("lm_head",)
    assert options.placement.weights == "stream" and options.safety.non_finite == "skip"
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.calibration.pieces = "blocks"
    assert options.replace(pieces="blocks").calibration.pieces == "blocks" and options.calibration.pieces == "layers"


@pytest.mark.parametrize(("settings", "error", "message"), [
    ({"pieces": "lyers"}, InvalidArgumentError, "unknown pieces 'lyers'; did you mean 'layers'?"),
    ({"weights": "ram"}, InvalidArgumentError, "unknown weights 'ram'"),
    ({"offload": "ram"}, InvalidArgumentError, "unknown offload 'ram'"),
    ({"num_calibration_samples": 0}, InvalidArgumentError, "num_calibration_samples (CLI: --num-samples)"),
    ({"targets_per_subgraph": 0}, InvalidArgumentError, "targets_per_subgraph"),
    ({"non_finite": "ignore"}, InvalidArgumentError, "non_finite must be one of"),
    ({"overwrite": "yes"}, InvalidArgumentError, "overwrite='yes'"),
    ({"packing": "pack"}, DatasetError, "unknown packing 'pack'"),
    ({"peices": "layers"}, InvalidArgumentError, "unknown compress option 'peices'; did you mean 'pieces'?"),
])
def test_a_bad_setting_is_refused_when_the_options_are_made(settings, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        CompressOptions.of(**settings)


def test_as_dict_is_json_ready_and_leaves_the_tokenizer_out():
    import json

    options = CompressOptions(calibration=CalibrationOptions(tokenizer=object(), sequential_targets=["X"]),
                              placement=PlacementOptions(device="cpu"))
    flat = options.as_dict()
    assert "tokenizer" not in flat and flat["sequential_targets"] == ["X"] and flat["device"] == "cpu"
    json.dumps(flat)


def test_the_everyday_arguments_override_the_options_and_the_summary_records_them():
    options = CompressOptions.of(num_calibration_samples=1, pieces="blocks")
    model = layerwise.compress(build_tiny_llama(), "W8A16", num_calibration_samples=3, show_progress=False,
                               device="cpu", options=options)
    recorded = model.layerwise_report.options
    assert recorded["num_calibration_samples"] == 3 and recorded["pieces"] == "blocks"
    assert recorded["device"] == "cpu"


def test_a_flat_setting_of_older_releases_still_runs_with_a_warning_naming_the_new_spelling():
    with pytest.warns(FlatOptionWarning, match=r"options=CompressOptions.of\(pieces=...\)"):
        model = layerwise.compress(build_tiny_llama(), "W8A16", show_progress=False, pieces="blocks")
    assert model.layerwise_report.options["pieces"] == "blocks"


def test_options_of_the_wrong_type_are_refused():
    with pytest.raises(InvalidArgumentError, match="options must be a CompressOptions, not dict"):
        layerwise.compress(build_tiny_llama(), "W8A16", show_progress=False, options={"pieces": "blocks"})
