"""Weights streamed from disk: compress a model larger than memory, one piece at a time.

The model is built with every parameter *unloaded* (:mod:`.placeholders`), traced as usual,
and each piece's tensors are read from the checkpoint (:mod:`.checkpoint`) when the piece
runs, written to the output shards (:mod:`.shards`) once it is done, and dropped
(:mod:`.stream`). Only one piece's weights are resident at a time.
"""

from layerwise.model_io.streaming.checkpoint import Checkpoint, CheckpointError
from layerwise.model_io.streaming.stream import (
           StreamingError,
           WeightStream,
           build_streamed_model,
           should_stream,
)

__all__ = ["Checkpoint", "CheckpointError", "StreamingError", "WeightStream", "build_streamed_model",
           "should_stream"]
