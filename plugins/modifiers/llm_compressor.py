"""The fields llm-compressor's recipes give its modifiers that layerwise's do not have, as data.

Each is a :class:`~layerwise.plugin.ForeignField`: ignored with a warning that says why nothing is
lost, or refused with the layerwise equivalent named. The modifiers set ``foreign_fields`` from
these tables; the recipe reader (:mod:`layerwise.host.recipe`) applies them.
"""

from __future__ import annotations

from layerwise.plugin import SESSION_FIELDS, ForeignField

_SEQUENTIAL_TARGETS = ForeignField(
    "the blocks calibrated one at a time are a run option in layerwise: "
    "compress(..., options=CompressOptions.of(sequential_targets=[...])) (CLI: --targets)", ignored=False)
_SEQUENTIAL_UPDATE = ForeignField(
    "layerwise always calibrates each layer on the inputs the layers already compressed produce "
    "(llm-compressor's sequential_update: true), so there is nothing to switch")
_OFFLOAD_HESSIANS = ForeignField(
    "layerwise keeps each Hessian as a float32 upper triangle, shared by the layers that read one input, and "
    "frees it as soon as its layer is solved; cached activations go to disk with the option offload='disk'")
QUANTIZATION = {
    **SESSION_FIELDS,
    "weight_observer": ForeignField("llm-compressor's name for layerwise's observer", rename="observer"),
    "output_observer": ForeignField(
        "layerwise quantizes no layer outputs (a config group's output_activations is refused), so there is no "
        "output range to observe"),
    "bypass_divisibility_checks": ForeignField(
        "layerwise checks before calibrating that each group size divides its layer; put a layer it does not "
        "divide in ignore, or use strategy: channel", ignored=False, layerwise_values=(False,)),
}
GPTQ = {**QUANTIZATION, "sequential_update": _SEQUENTIAL_UPDATE, "offload_hessians": _OFFLOAD_HESSIANS,
        "sequential_targets": _SEQUENTIAL_TARGETS, "batched_quantization": ForeignField(
            "llm-compressor's speed setting (same-shape layers solved as one batch); layerwise solves each layer "
            "on its own Hessian, which gives the same result")}
AWQ = {**QUANTIZATION, "sequential_targets": _SEQUENTIAL_TARGETS, "offload_device": ForeignField(
    "layerwise keeps one block's search samples in memory at a time (search_tokens caps them), on the "
    "device calibration runs on")}
AUTOROUND = {
    **QUANTIZATION,
    "sequential_targets": _SEQUENTIAL_TARGETS,
    "enable_torch_compile": ForeignField(
        "layerwise compiles AutoRound's steps with its own field compile: true (off by default); the steps "
        "compute the same either way"),
    "device_ids": ForeignField(
        "layerwise tunes each block on the run's execution device (compress(..., device=...), CLI --device); "
        "several GPUs are several ranks (torchrun), each block tuned on one", ignored=False),
    "disable_opt_rtn": ForeignField(
        "layerwise's AutoRound has no separate optimized round-to-nearest mode: iters: 0 keeps round-to-nearest"),
}
SMOOTHQUANT = {
    **SESSION_FIELDS,
    "num_calibration_steps": ForeignField(
        "SmoothQuant reads every calibration sample of the run (num_calibration_samples)"),
    "ignore": ForeignField(
        "SmoothQuantModifier smooths the mappings it is given: choose them with mappings (or leave layers "
        "unquantized with the run's ignore option)", ignored=False),
    "calibration_function": ForeignField(
        "layerwise feeds the calibration batches to the model's own forward; give tokenized samples as the "
        "dataset if the model needs other inputs", ignored=False),
}
PRUNING = {
    **SESSION_FIELDS,
    "sequential_update": ForeignField(
        "layerwise's SparseGPT and Wanda calibrate a block's layers on its unpruned inputs, as their papers do; "
        "true_sequential: true calibrates each layer on the outputs of the layers pruned before it"),
    "sequential_targets": _SEQUENTIAL_TARGETS,
    "preserve_sparsity_mask": ForeignField(
        "a layer layerwise pruned keeps its zeros through every later modifier (GPTQ quantizes them to 0)"),
    "sparsity_profile": ForeignField(
        "layerwise's OWL is on exactly when owl_m and owl_lmbda are given (llm-compressor's sparsity_profile: owl, "
        "which it requires beside them); there is no other profile"),
}
SPARSEGPT = {**PRUNING, "offload_hessians": _OFFLOAD_HESSIANS}
