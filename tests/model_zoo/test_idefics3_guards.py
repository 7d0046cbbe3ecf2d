"""Idefics3 with only its text layers as targets: the inlined vision attention tests its mask.

transformers' ``create_bidirectional_mask`` returns ``None`` for a full pixel mask and a tensor
for a padded one; eager vision attention adds the mask when it is not ``None``. Before guards,
the trace baked the tensor case in and replay crashed on ``Tensor + None``.
"""

from __future__ import annotations

import warnings

import layerwise
from layerwise.model_io.calibration_data import CalibrationWarning
from layerwise.model_zoo.idefics3 import IDEFICS3, TEXT_LAYERS, sample_inputs
from layerwise.model_zoo.idefics3 import tiny_idefics3 as idefics3
from layerwise.tracing import trace
from layerwise.tracing.retrace import TracesByGuards
from layerwise.verbs.compression import compress
from tests.conftest import skip_unless_verified


def _model_and_batches():
    skip_unless_verified(IDEFICS3)
    model = idefics3()
    model.set_attn_implementation("eager")
    full = sample_inputs(model.config, "image", batch=1)
    padded = dict(full, pixel_attention_mask=full["pixel_attention_mask"].clone())
    padded["pixel_attention_mask"][..., 28:, :] = False  # the lower half of the image is padding
    return model, full, padded


def test_text_targets_on_images_replay_exactly_for_full_and_padded_images() -> None:
    model, full, padded = _model_and_batches()
    result = trace(model, full, sequential_targets=[TEXT_LAYERS])
    assert len(result.subgraphs) == 3
    mask_guard = next(g for g in result.guards if g.how == "create_bidirectional_mask")
    assert mask_guard.expected == "None"  # what the real full mask gives, learned from the sample
    assert result.verify(full) <= 1e-5

    traces = TracesByGuards(lambda sample: trace(model, sample, sequential_targets=[TEXT_LAYERS]))
    assert [traces.for_batch(b) for b in (full, padded, full)] == [0, 1, 0]
    assert "create_bidirectional_mask" in traces.retraced[0]
    assert traces.traces[1].verify(padded) <= 1e-5


def test_compress_calibrates_mixed_batches_sequentially_without_falling_back() -> None:
    model, full, padded = _model_and_batches()
    recipe = {"GPTQModifier": {"scheme": "W8A16", "ignore": ["lm_head"]}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning, no other warning
        warnings.filterwarnings("ignore", category=CalibrationWarning)  # but two samples are few: said, and known
        compress(model, recipe, dataset=[full, padded], show_progress=False, options=layerwise.CompressOptions.of(sequential_targets=[TEXT_LAYERS]))
    report = model.layerwise_report
    assert report.pipeline == "sequential" and not report.fallbacks
    (retraced,) = report.guards_retraced  # the padded image broke the full image's mask guard
    assert "create_bidirectional_mask" in retraced and "batch 1 gave Tensor" in retraced
    assert any("text_model.layers.1" in name for name in report.compressed_modules)
