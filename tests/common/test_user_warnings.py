"""Each layerwise warning is printed once (warnings only, not also logging) and names the user's line."""

from __future__ import annotations

import logging
import warnings

import layerwise
from layerwise.host.pipeline_selection import PipelineFallbackWarning
from layerwise.plugins.modifiers.gptq import GPTQFallbackWarning
from tests.host.test_pipeline_selection import Untraceable
from tests.plugins.pipelines.helpers import make_batches


def test_fallback_warnings_are_printed_once_and_point_at_the_compress_call(caplog):
    caplog.set_level(logging.DEBUG, logger="layerwise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        layerwise.compress(Untraceable().eval(), "GPTQ_W8A16", dataset=make_batches(), show_progress=False)
    ours = [w for w in caught if issubclass(w.category, (PipelineFallbackWarning, GPTQFallbackWarning))]
    # the pipeline fallback (compress -> pipeline) and the head's RTN fallback (raised under torch's hooks)
    assert {w.category for w in ours} == {PipelineFallbackWarning, GPTQFallbackWarning}
    for w in ours:
        assert w.filename == __file__, f"{w.category.__name__} points at {w.filename}:{w.lineno}"
        message = str(w.message)
        assert [str(c.message) for c in caught].count(message) == 1
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.getMessage() == message]
