"""Per-architecture knowledge, declared as data, picked automatically for a model.

A :class:`ModelPatch` says which blocks to calibrate one at a time, what to leave
alone, what the tracer must treat as opaque, and how to build sample inputs.
Patches come from plugins (``layerwise_register_model_patches``); the model zoo
ships the built-in ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from layerwise.algorithms.quantization.rotation import RotationLayout


@dataclass(frozen=True)
class ModelPatch:
    """Declarative knowledge about one architecture family."""

    name: str
    #: ``config.model_type`` values this patch covers
    model_types: tuple[str, ...] = ()
    #: model class names (``LlamaForCausalLM``); a class match beats a model_type match
    architectures: tuple[str, ...] = ()
    #: module class names (or ``re:`` patterns) calibrated one at a time
    sequential_targets: tuple[str, ...] = ()
    #: modules never compressed (class names, qualified names or ``re:`` patterns)
    ignore: tuple[str, ...] = ()
    #: functions the tracer must call opaquely instead of tracing through
    opaque_functions: tuple[Callable[..., Any], ...] = ()
    #: module class names the tracer keeps as single calls
    leaf_modules: tuple[str, ...] = ()
    #: in-place tweak applied once when the model loads (smallest traceable override)
    apply: Callable[[torch.nn.Module], None] | None = None
    #: context manager active during calibration only (e.g. MoE all-expert routing)
    calibration_context: Callable[[torch.nn.Module], contextlib.AbstractContextManager] | None = None
    #: ``sample_inputs(config, modality) -> dict`` for tracing and tests, no downloads
    sample_inputs: Callable[[Any, str], dict[str, Any]] | None = None
    #: builders of seeded tiny models (random weights, no downloads) of the layouts this patch covers:
    #: what ``layerwise plugins --check`` runs the plugin kit on
    tiny_models: tuple[Callable[[], torch.nn.Module], ...] = ()
    #: SmoothQuant / AWQ (balance layers, smoothed layer) mappings as regex pairs
    smoothing_mappings: tuple[tuple[tuple[str, ...], str], ...] = ()
    #: the attention modules whose keys / values a ``kv_cache_scheme`` quantizes: class names, qualified names or
    #: ``re:`` patterns (empty: every module whose class name ends in ``Attention`` with ``k_proj`` and
    #: ``v_proj``). Only those with a KV cache in vLLM: a VLM names its text decoder's attention, not its vision
    #: encoder's (an encoder caches nothing, and text calibration data never reaches it)
    attention_modules: tuple[str, ...] = ()
    #: why this family's KV cache cannot be quantized, and what to do instead: a ``kv_cache_scheme`` is refused
    #: with it before any work (empty: supported)
    kv_cache_refusal: str = ""
    #: where the residual stream is read and written, for RotationModifier (``None``: the Llama-like layout)
    rotation_layout: RotationLayout | None = None
    #: sibling projections (leaf names under one parent, e.g. ``("wq", "wk", "wv")``) that vLLM loads into one
    #: fused matrix with ONE NVFP4 global scale, so they must share it: added to the default table (q/k/v,
    #: gate/up, query/key/value, w1/w3; :data:`~layerwise.algorithms.quantization.global_scales.FUSED_PROJECTIONS`),
    #: not instead of it, and a leaf named here takes this set before the table's. Only for checkpoints that keep
    #: the siblings as separate tensors (an already fused ``qkv_proj`` needs nothing)
    fused_projections: tuple[tuple[str, ...], ...] = ()
    #: one expert's (gate, up, down) leaf names, as the family's per-expert checkpoints name them, for checkpoints
    #: holding transformers 5's fused experts (``<experts>.gate_up_proj`` ``(experts, 2 * intermediate, hidden)``,
    #: gate rows first; ``<experts>.down_proj`` ``(experts, hidden, intermediate)``): the in-memory run unfuses them
    #: into ``<experts>.<e>.<name>`` Linear layers (``apply``) and model-free splits the 3-D tensors into the same
    #: names from this field alone, as data, without building the model; each expert's gate and up share an NVFP4
    #: global scale (vLLM fuses them). Empty: no fused experts to split (model-free leaves 3-D tensors dense)
    expert_projections: tuple[str, ...] = ()
    #: transformers versions this patch was verified against
    verified_transformers: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        # a dotted or repeated leaf would never match, or match two sets: say so when the patch is written
        leaves = [leaf for members in self.fused_projections for leaf in members]
        bad = [leaf for leaf in leaves if not isinstance(leaf, str) or not leaf or "." in leaf]
        if bad or len(set(leaves)) != len(leaves) or any(isinstance(m, str) for m in self.fused_projections):
            raise ValueError(f"ModelPatch {self.name!r}: fused_projections must be tuples of distinct leaf module "
                             f"names (no dots), each in one set, e.g. (('wq', 'wk', 'wv'),); got "
                             f"{self.fused_projections!r}")
        names = self.expert_projections
        if names and (isinstance(names, str) or len(names) != 3 or len(set(names)) != 3
                      or any(not isinstance(n, str) or not n or "." in n for n in names)):
            raise ValueError(f"ModelPatch {self.name!r}: expert_projections must be three distinct leaf module names "
                             f"(no dots): an expert's gate, up and down, e.g. ('gate_proj', 'up_proj', 'down_proj'); "
                             f"got {names!r}")

    def shared_scale_sets(self) -> tuple[tuple[str, ...], ...]:
        """The leaf-name sets this patch adds to those sharing an NVFP4 global scale (see
        :func:`~layerwise.algorithms.quantization.global_scales.fused_sets`): ``fused_projections``, then each
        expert's gate and up (``expert_projections``), which vLLM loads as one matrix."""
        experts = (tuple(self.expert_projections[:2]),) if self.expert_projections else ()
        return (*self.fused_projections, *experts)

    def match_score(self, model: torch.nn.Module) -> int:
        """2 for a class-name match, 1 for a model_type match, 0 for none."""
        if type(model).__name__ in self.architectures:
            return 2
        config = getattr(model, "config", None)
        if config is not None and getattr(config, "model_type", None) in self.model_types:
            return 1
        return 0

    def config_match_score(self, config: Mapping[str, Any]) -> int:
        """:meth:`match_score` from a checkpoint's ``config.json`` alone (a model-free run builds no model): 2 when
        one of its ``architectures`` is a class this patch names, 1 for its ``model_type``, 0 for none."""
        architectures = config.get("architectures") or ()
        if isinstance(architectures, str):
            architectures = (architectures,)
        if any(name in self.architectures for name in architectures):
            return 2
        return 1 if config.get("model_type") in self.model_types else 0

    @contextlib.contextmanager
    def calibrating(self, model: torch.nn.Module) -> Iterator[None]:
        """Enter the patch's calibration context, if it has one."""
        if self.calibration_context is None:
            yield
        else:
            with self.calibration_context(model):
                yield
