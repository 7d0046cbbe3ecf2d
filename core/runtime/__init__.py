"""What a pipeline runs on: placement, memory, the activations cache, devices and ranks.

Owns where tensors rest and move (offload to the execution device and back, the intermediates
cache, the heap, mapped pages), devices and out-of-memory messages, data-parallel ranks, the
resume checkpoint, the accounting of time per phase and the finite checks. May import
``layerwise.host``, ``layerwise.algorithms``, ``layerwise.common`` and ``layerwise.errors``.
"""
