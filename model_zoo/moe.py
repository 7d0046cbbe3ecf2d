"""Shared machinery for mixture-of-experts patches: per-expert Linear layers and all-token calibration.

transformers 5 stores a MoE layer's experts fused, as two 3-D parameters on one ``*Experts``
module (``gate_up_proj``: ``(experts, 2 * intermediate, hidden)``, gate rows first;
``down_proj``: ``(experts, hidden, intermediate)``), called as
``experts(hidden_states, top_k_index, top_k_weights)`` on flattened tokens. There is no
``nn.Linear`` per expert, so Linear-targeting compression (GPTQ, RTN, ...) would never see
the experts -- the bulk of a MoE model's weights.

Two tools, both generic over every experts module with that layout (Qwen3-MoE, Mixtral,
DeepSeek-V3, ...):

* :func:`unfuse_experts` (the patches' ``apply``) replaces each fused experts module with
  :class:`LinearExperts`: one :class:`ExpertMLP` per expert holding gate / up / down
  ``nn.Linear`` layers named as the family's original per-expert checkpoints name them
  (``gate_proj``/``up_proj``/``down_proj``, Mixtral's ``w1``/``w3``/``w2``: transformers maps
  those names back onto its fused experts when it loads a saved model), same call, same output.
* :func:`calibrate_all_experts` (the patches' ``calibration_context``) swaps each experts
  module's forward, for the duration of the ``with`` block, for one that runs **every** expert
  on **every** token -- so every expert's Hessian sees all the calibration data -- and then
  combines only the top-k routed outputs with their routing weights, in the same order as the
  normal forward, so the layer's output is that of normal top-k routing. The original forward
  is restored on exit, also on error.
"""

from __future__ import annotations

import contextlib
import gc
import types
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from layerwise.plugin import TESTED_TRANSFORMERS, ModelPatch, applied_patch

from . import _inputs, _tiny

if TYPE_CHECKING:
    from layerwise.plugin.quantization import Mapping, RotationLayout

__all__ = [
    "MOE_IGNORE",
    "ExpertMLP",
    "LinearExperts",
    "calibrate_all_experts",
    "find_experts",
    "is_fused_experts",
    "moe_smoothing_mappings",
    "text_moe_patch",
    "unfuse_declared_experts",
    "unfuse_experts",
]

#: routers: in transformers 5 they are ``*TopKRouter`` modules named ``mlp.gate`` (plain weight, no Linear);
#: Mixtral's checkpoints name them ``block_sparse_moe.gate`` (transformers renames them on load and back on
#: save), which is what a model-free run, reading the checkpoint's names, sees
MOE_IGNORE = ("lm_head", "re:.*(mlp|block_sparse_moe)\\.gate$")


#: the per-expert layer names of most original checkpoints (Qwen-MoE, DeepSeek): gate, up, down
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def uninitialised_linear(n_in: int, n_out: int, bias: bool = False, device: torch.device | str | None = None,
                         dtype: torch.dtype | None = None) -> nn.Linear:
    """``nn.Linear(n_in, n_out)`` with empty parameters: no init, no second allocation (``skip_init`` builds on
    meta, then ``to_empty``; a 256-expert model's 44,544 layers took 26 s that way, on meta too)."""
    weight = nn.Parameter(torch.empty(n_out, n_in, device=device, dtype=dtype))
    bias_ = nn.Parameter(torch.empty(n_out, device=device, dtype=dtype)) if bias else None
    return _built(nn.Linear, {"in_features": n_in, "out_features": n_out}, {"weight": weight, "bias": bias_})


def _built(cls: type[nn.Module], attributes: dict[str, Any], parameters: dict[str, Any] | None = None,
           modules: dict[str, nn.Module] | None = None) -> Any:
    """An instance of ``cls`` as ``nn.Module.__init__`` leaves one, with ``attributes``, ``parameters`` and
    ``modules`` set, made without ``__init__`` and ``nn.Module.__setattr__``.

    Why: unfusing a 256-expert model builds 44,544 Linear layers and 14,848 expert modules; through
    ``__init__`` and ``__setattr__`` (a dozen registrations each) that took ~9 s on meta, most of
    ``layerwise plan``'s time for DeepSeek-V3. A bare module's state is copied from an empty one, each
    container (hook dicts, buffer sets) a fresh empty one of its type.
    """
    module = cls.__new__(cls)
    state = module.__dict__
    for key, kind in _CONTAINERS:
        state[key] = kind()
    state.update(_CONSTANTS)
    if parameters:
        state["_parameters"].update(parameters)
    if modules:
        state["_modules"].update(modules)
    state.update(attributes)
    return module


def _empty_state() -> tuple[tuple[tuple[str, type], ...], dict[str, Any]]:
    fresh = nn.Module()
    containers = tuple((k, type(v)) for k, v in vars(fresh).items() if isinstance(v, (dict, set, list)))
    constants = {k: v for k, v in vars(fresh).items() if not isinstance(v, (dict, set, list))}
    return containers, constants


_CONTAINERS, _CONSTANTS = _empty_state()


class ExpertMLP(nn.Module):
    """One expert as three Linear layers: ``down(act(gate(x)) * up(x))``, named as the family's original
    checkpoints name them (``names``: gate, up, down), so a saved model loads where the original does."""

    def __init__(self, hidden: int, intermediate: int, act_fn: Any, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 names: tuple[str, str, str] = EXPERT_NAMES) -> None:
        super().__init__()
        # uninitialised: the weights are copied in from the fused experts (a random init of every
        # expert of a 671B model, or of one on meta, costs minutes for nothing)
        def linear(n_in: int, n_out: int) -> nn.Linear:
            return uninitialised_linear(n_in, n_out, bias, device, dtype)

        self.names = names
        for name, (n_in, n_out) in zip(names, ((hidden, intermediate), (hidden, intermediate), (intermediate, hidden))):
            setattr(self, name, linear(n_in, n_out))
        self.act_fn = act_fn

    @classmethod
    def empty(cls, hidden: int, intermediate: int, act_fn: Any, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None, names: tuple[str, str, str] = EXPERT_NAMES) -> ExpertMLP:
        """The same module as ``ExpertMLP(...)`` (no bias), built without ``__init__`` (see :func:`_built`)."""
        shapes = ((hidden, intermediate), (hidden, intermediate), (intermediate, hidden))
        layers = {name: uninitialised_linear(n_in, n_out, False, device, dtype)
                  for name, (n_in, n_out) in zip(names, shapes)}
        if isinstance(act_fn, nn.Module):  # as nn.Module.__setattr__ files it
            return _built(cls, {"names": names}, modules={**layers, "act_fn": act_fn})
        return _built(cls, {"names": names, "act_fn": act_fn}, modules=layers)

    @property
    def layers(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        """(gate, up, down) whatever their names."""
        return tuple(getattr(self, name) for name in self.names)  # type: ignore[return-value]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.layers
        return down(self.act_fn(gate(x)) * up(x))


class LinearExperts(nn.ModuleList):
    """Per-expert Linear layers with the fused experts' call: ``(tokens, top_k_index, top_k_weights)``."""

    def __init__(self, experts: list[ExpertMLP]) -> None:
        super().__init__(experts)
        self.num_experts = len(experts)

    @classmethod
    def of(cls, experts: list[ExpertMLP]) -> LinearExperts:
        """The same module as ``LinearExperts(experts)``, built without ``__init__`` (see :func:`_built`)."""
        return _built(cls, {"num_experts": len(experts)}, modules={str(e): mlp for e, mlp in enumerate(experts)})

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return _combine(hidden_states, top_k_index, top_k_weights, self.num_experts,
                        lambda e, x: self[e](x), all_tokens=False)


def is_fused_experts(module: nn.Module) -> bool:
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3
            and isinstance(down, torch.Tensor) and down.dim() == 3)


def find_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Every experts module (fused 3-D or :class:`LinearExperts`), by qualified name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LinearExperts) or is_fused_experts(m)}


def _check_layout(name: str, experts: nn.Module) -> None:
    unsupported = [flag for flag, bad in (("is_transposed", True), ("is_concatenated", False), ("has_gate", False),
                                          ("has_bias", True), ("has_post_expert_norm", True))
                   if getattr(experts, flag, not bad) == bad]
    if unsupported:
        raise NotImplementedError(f"experts module {name!r} ({type(experts).__name__}) uses a layout "
                                  f"layerwise cannot unfuse yet: {', '.join(unsupported)}")


def _fused_expert(experts: nn.Module, e: int, x: torch.Tensor) -> torch.Tensor:
    gate, up = nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return nn.functional.linear(experts.act_fn(gate) * up, experts.down_proj[e])


def _combine(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
             num_experts: int, run_expert, all_tokens: bool) -> torch.Tensor:
    """Weighted sum of the routed experts' outputs, added expert by expert (transformers' order).

    With ``all_tokens`` every expert runs on every token and only the routed rows are kept.
    """
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = nn.functional.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
    for e in range(num_experts):
        top_k_pos, token_idx = torch.where(expert_mask[e])
        if all_tokens:
            out = run_expert(e, hidden_states)[token_idx]
        elif token_idx.numel() == 0:
            continue
        else:
            out = run_expert(e, hidden_states[token_idx])
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def unfuse_experts(model: nn.Module, names: tuple[str, str, str] = EXPERT_NAMES) -> nn.Module:
    """Replace every fused experts module with :class:`LinearExperts` holding the same weights.

    The garbage collector is paused meanwhile: the tens of thousands of modules made here (and the
    hook dicts in each) trigger collections that each walk every object made so far, which cost 4x
    the building itself on a 256-expert model.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _unfuse_experts(model, names)
    finally:
        if enabled:
            gc.enable()


def _unfuse_experts(model: nn.Module, names: tuple[str, str, str]) -> nn.Module:
    for name, experts in list(find_experts(model).items()):
        if isinstance(experts, LinearExperts):
            continue
        _check_layout(name, experts)
        num, inter2, hidden = experts.gate_up_proj.shape
        inter = inter2 // 2
        weight = experts.gate_up_proj
        mlps = []
        for e in range(num):
            mlp = ExpertMLP.empty(hidden, inter, experts.act_fn, device=weight.device, dtype=weight.dtype, names=names)
            if weight.device.type != "meta":  # on meta there is nothing to copy (the planner's model)
                gate, up, down = mlp.layers
                with torch.no_grad():
                    gate.weight.copy_(weight[e, :inter])
                    up.weight.copy_(weight[e, inter:])
                    down.weight.copy_(experts.down_proj[e])
            mlps.append(mlp)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, LinearExperts.of(mlps))
    return model


def _all_tokens_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    if isinstance(self, LinearExperts):
        run, num = (lambda e, x: self[e](x)), self.num_experts
    else:
        run, num = (lambda e, x: _fused_expert(self, e, x)), self.gate_up_proj.shape[0]
    return _combine(hidden_states, top_k_index, top_k_weights, num, run, all_tokens=True)


@contextlib.contextmanager
def calibrate_all_experts(model: nn.Module) -> Iterator[list[str]]:
    """Within the block every expert computes every token; outputs stay top-k routed.

    Yields the names of the experts modules it swapped. Restores each module's forward on
    exit, whether the block finished or raised.
    """
    swapped: list[tuple[nn.Module, Any]] = []
    try:
        for name, experts in find_experts(model).items():
            if not isinstance(experts, LinearExperts):
                _check_layout(name, experts)
            swapped.append((experts, experts.__dict__.get("forward", _MISSING)))
            experts.forward = types.MethodType(_all_tokens_forward, experts)
        yield [n for n, m in find_experts(model).items() if any(m is s for s, _ in swapped)]
    finally:
        for experts, previous in reversed(swapped):
            if previous is _MISSING:
                experts.__dict__.pop("forward", None)
            else:
                experts.forward = previous


_MISSING = object()


def tiny_text_moe(class_prefix: str, random_routers: bool = False, **sizes: Any) -> torch.nn.Module:
    """A seeded 2-layer ``<class_prefix>ForCausalLM`` sized by ``sizes``; ``random_routers`` redraws
    routers that start at zero (DeepSeek-V3's), which would send every token to the same experts."""
    import transformers

    config = getattr(transformers, f"{class_prefix}Config")(**{**_tiny.TEXT, **sizes})
    model = _tiny.seeded(f"{class_prefix}ForCausalLM", config)
    if random_routers:
        with torch.no_grad():
            generator = _inputs.generator(1)
            for name, parameter in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model


def moe_smoothing_mappings(attention_inputs: tuple[str, ...], expert_names: tuple[str, str, str] = EXPERT_NAMES,
                           v_to_o: bool = True) -> tuple[Mapping, ...]:
    """The smoothing mappings of a pre-norm MoE decoder (see :mod:`layerwise.algorithms.quantization.mappings`).

    ``input_layernorm`` feeds the attention's ``attention_inputs`` (``self_attn.<name>``);
    ``post_attention_layernorm`` feeds the router (``mlp.gate``), every expert's gate and up layers
    (``expert_names``), a shared expert's and a dense layer's (``mlp.gate_proj`` of DeepSeek's first
    layers): every reader, or the function would change. ``v_to_o`` adds ``v_proj`` -> ``o_proj``
    (skipped by the resolver under grouped-query attention).
    """
    gate, up, _ = expert_names
    mappings: tuple[Mapping, ...] = (
        (tuple(f"re:.*self_attn\\.{n}" for n in attention_inputs), "re:.*input_layernorm"),
        (("re:.*mlp\\.gate", f"re:.*mlp\\.(.*\\.)?{gate}", f"re:.*mlp\\.(.*\\.)?{up}"),
         "re:.*post_attention_layernorm"),
    )
    return (*mappings, (("re:.*self_attn\\.o_proj",), "re:.*self_attn\\.v_proj")) if v_to_o else mappings


def text_moe_patch(name: str, family: str, model_type: str, class_prefix: str,
                   tiny_sizes: dict[str, Any] | None = None,
                   expert_names: tuple[str, str, str] = EXPERT_NAMES,
                   smoothing_mappings: tuple[Mapping, ...] = (),
                   rotation_layout: RotationLayout | None = None) -> ModelPatch:
    """The patch every text MoE family shares: one ``<prefix>DecoderLayer`` at a time,
    fused experts unfused into Linear layers, every expert calibrated on every token."""

    def tiny_builder() -> torch.nn.Module:
        return tiny_text_moe(class_prefix, **(tiny_sizes or {}))

    tiny_builder.__name__ = tiny_builder.__qualname__ = f"tiny_{name}"

    def sample_inputs(config, modality: str = "text", batch: int = 2, seq_len: int = 16):
        _inputs.check_modality(family, modality, (_inputs.TEXT,))
        return _inputs.text_inputs(config.vocab_size, batch, seq_len, avoid=_inputs.special_ids(config))

    return ModelPatch(
        name=name,
        model_types=(model_type,),
        architectures=(f"{class_prefix}ForCausalLM", f"{class_prefix}Model"),
        sequential_targets=(f"{class_prefix}DecoderLayer",),
        ignore=MOE_IGNORE,
        expert_projections=expert_names,
        apply=unfuse_declared_experts,
        calibration_context=calibrate_all_experts,
        sample_inputs=sample_inputs,
        tiny_models=(tiny_builder,),
        smoothing_mappings=smoothing_mappings,
        rotation_layout=rotation_layout,
        verified_transformers=TESTED_TRANSFORMERS.releases,
    )


def unfuse_declared_experts(model: nn.Module) -> None:
    """The MoE patches' ``apply``: :func:`unfuse_experts` with the names the ``expert_projections`` of the patch
    being applied declare (read from the model, so a copy made with ``dataclasses.replace(patch,
    expert_projections=...)`` unfuses by its own names): the one declaration model-free splits fused checkpoints
    by too, so that both runs name the experts' layers alike."""
    patch = applied_patch(model)
    names = tuple(patch.expert_projections) if patch is not None and patch.expert_projections else EXPERT_NAMES
    unfuse_experts(model, names=names)  # type: ignore[arg-type]
