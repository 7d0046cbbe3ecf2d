"""Telling the user what happened: the run summary, its charts, and quality measurements.

Owns the saved ``layerwise_summary.json`` and its reader, text and SVG charts of the per-layer
error, the report card of a compressed model against its original (``quality``: perplexity, KL
divergence, agreement, embedding cosine; ``task_accuracy``: the lm-eval bridge), the model card
written beside the weights (``model_card``), and the support matrix of the zoo. Reading a report
never needs the compression stack: ``layerwise report`` imports this package only (and what it
imports: ``layerwise.common``, ``layerwise.errors``, ``layerwise.host``, ``layerwise.runtime``).
"""
