"""Planning a run before it starts: will it fit, how long, will it serve (``layerwise plan``).

:func:`~layerwise.planning.plan.make_plan` builds the model on the meta device from its config
(sizes from the safetensors headers, no weight read), runs the recipe's checks on it, and
estimates memory, disk, time and output size; ``compress()`` runs the same checks first.
"""
