"""Online Hadamard rotations of a Linear's input (QuaRot's R4 before ``down_proj``).

A rotation of the residual stream folds into the weights on both sides of it. The input of an
MLP's ``down_proj`` cannot be rotated that way: the product ``act(gate) * up`` that feeds it is not
linear, so nothing before it can absorb the rotation. Instead the rotation runs at inference:
``down_proj``'s weight becomes ``W H`` (folded once, in float64) and its input ``x`` becomes ``x H``
on every call (``H = blockdiag(H_b) / sqrt(b)``, symmetric and orthogonal), so ``x H (W H)^T = x W^T``.
The 4-bit quantizers then see spread-out activations instead of the few huge channels that the
MLP's product makes.

The online half is a forward pre-hook (:class:`OnlineHadamard`, first in line) that stays on the
module as part of its function, so the calibration that follows sees what inference will: GPTQ's
Hessian hooks and the input quantizer read the rotated input. It is written to config.json as
compressed-tensors' ``transform_config`` (type ``hadamard``: Sylvester's matrix, which this module's
:func:`~layerwise.algorithms.quantization.hadamard.fwht` multiplies by), the weight side marked as
fused already; :func:`attach_from_transform_config` puts the online half back on load.

A Hadamard alone is a fixed basis: an input whose large channels line up with its structure stays
spiky after it. QuaRot and SpinQuant draw a *random* Hadamard, ``H D`` with ``D`` a diagonal of random
signs, which no input can line up with. :func:`flip_online_signs` gets the same matrix for free: ``D``
folds exactly into the Linear whose output scales the rotated input elementwise (``up_proj``:
``act(gate) * (up D) = (act(gate) * up) D``) and into the online layer's columns, before the Hadamard is
folded. The online half stays Sylvester's deterministic ``hadamard``, so the checkpoint and what
vLLM runs are unchanged; only the weights differ (multiplying by +-1 is exact).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from layerwise.algorithms.quantization.hadamard import HadamardSizeError, check_block, fwht
from layerwise.algorithms.quantization.storage import replace_data
from layerwise.common.matching import find_modules, paired_by_parent

#: the config group name of the online rotations in ``transform_config`` (QuaRot / SpinQuant's name)
GROUP = "R4"
#: added to the seed of :func:`flip_online_signs`: its draws apart from the residual rotation's, drawn from the seed
SIGN_STREAM = 0x51645


class OnlineRotationError(ValueError):
    """An online rotation that cannot be made or reproduced (a width with no Hadamard, an unknown transform)."""


class OnlineHadamard:
    """Forward pre-hook: the module's input times ``blockdiag(H_block) / sqrt(block)``, computed in ``precision``
    (float32 by default, compressed-tensors' default for online transforms) and returned in the input's dtype."""

    #: part of the model's function, not a calibration hook: it stays after the run (see core/testing/modifiers.py)
    part_of_model = True

    def __init__(self, block: int, precision: torch.dtype = torch.float32) -> None:
        self.block = block
        self.precision = precision

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if not args or not isinstance(args[0], Tensor):
            return None
        x = args[0]
        return (fwht(x.to(self.precision), self.block).to(x.dtype), *args[1:])

    def __repr__(self) -> str:
        return f"OnlineHadamard(block={self.block}, precision={self.precision})"


def online_hadamard(module: nn.Module) -> OnlineHadamard | None:
    """The online rotation on ``module``'s input, if it has one."""
    hook = module.__dict__.get("online_hadamard")
    return hook if isinstance(hook, OnlineHadamard) else None


def online_hadamards(model: nn.Module) -> dict[str, OnlineHadamard]:
    """Every module of ``model`` whose input is rotated online, by qualified name."""
    return {name: hook for name, m in model.named_modules() if (hook := online_hadamard(m)) is not None}


def attach(module: nn.Module, block: int, precision: torch.dtype = torch.float32) -> OnlineHadamard:
    """Rotate ``module``'s input online from now on (its weight untouched: see :func:`rotate_inputs_online`)."""
    if online_hadamard(module) is not None:
        raise OnlineRotationError(f"{type(module).__name__} already rotates its input online; rotating twice would "
                                  f"not cancel against its weight")
    hook = OnlineHadamard(block, precision)
    module.__dict__["online_hadamard"] = hook
    module.register_forward_pre_hook(hook, prepend=True)
    return hook


@torch.no_grad()
def fold_input_hadamard(module: nn.Module, block: int) -> None:
    """``W := W blockdiag(H_block) / sqrt(block)``, in float64, stored in the weight's dtype (bias unchanged)."""
    weight = module.weight
    replace_data(weight, fwht(weight.detach().to(torch.float64), block).to(weight.dtype))


def rotate_inputs_online(model: nn.Module, patterns: Iterable[str], block: int | None = None,
                         owner: str = "RotationModifier") -> list[str]:
    """Fold a Hadamard into the input side of every Linear matching ``patterns`` and rotate its input online
    (``block``: the Hadamard's size, default each layer's input width). The model's function is unchanged."""
    patterns = list(patterns)
    layers = find_modules(model, patterns)
    if not layers:
        raise OnlineRotationError(f"{owner}: the online rotation patterns {patterns} match no module of "
                                  f"{type(model).__name__}; declare rotation_layout.online in its model patch "
                                  f"(GUIDE.md, 'Rotations')")
    sizes = {}
    for name, module in layers.items():  # every check before any change
        if not isinstance(module, nn.Linear):
            raise OnlineRotationError(f"{owner}: {name!r} is a {type(module).__name__}; online rotations go before "
                                      f"nn.Linear layers only")
        if module.weight.device.type == "meta":
            raise OnlineRotationError(f"{owner}: {name!r} has no weights in memory (meta device); rotations need "
                                      f"the model loaded")
        try:
            sizes[name] = check_block(module.in_features, block, f"the online rotation of {name!r}")
        except HadamardSizeError as exc:
            raise OnlineRotationError(f"{owner}: {exc} (RotationModifier.block_size)") from None
        if online_hadamard(module) is not None:
            raise OnlineRotationError(f"{owner}: {name!r} already rotates its input online")
    for name, module in layers.items():
        fold_input_hadamard(module, sizes[name])
        attach(module, sizes[name])
    return list(layers)


@torch.no_grad()
def flip_online_signs(model: nn.Module, patterns: Sequence[str], seed: int = 0,
                      owner: str = "RotationModifier") -> list[str]:
    """Random signs on the channels between each ``(scale pattern, online pattern)`` pair, paired by their parent
    module: the scale layer's output rows (and bias) and the online layer's input columns times the same ``+-1``
    (one draw per pair, from ``seed``). Exact, the model's function unchanged; call it before
    :func:`rotate_inputs_online` so the online Hadamard becomes ``H D``. Returns the online layers."""
    if len(patterns) != 2:
        raise OnlineRotationError(f"{owner}: rotation_layout.online_signs must be (scale pattern, online pattern), "
                                  f"got {tuple(patterns)}")
    pairs, scales, onlines = paired_by_parent(model, *patterns)
    if pairs is None:
        raise OnlineRotationError(f"{owner}: rotation_layout.online_signs {tuple(patterns)} must match one scale and "
                                  f"one online layer per module of {type(model).__name__}; found {scales[:3]}"
                                  f"... and {onlines[:3]}...")
    for scale, online in pairs:
        up, down = model.get_submodule(scale), model.get_submodule(online)
        if not isinstance(up, nn.Linear) or not isinstance(down, nn.Linear) or up.out_features != down.in_features:
            raise OnlineRotationError(f"{owner}: {scale!r} ({type(up).__name__}) must be a Linear whose outputs are "
                                      f"the inputs of the Linear {online!r} ({type(down).__name__})")
        if online_hadamard(down) is not None:
            raise OnlineRotationError(f"{owner}: {online!r} rotates its input online already; its signs must be "
                                      f"flipped before the Hadamard is folded")
    generator = torch.Generator().manual_seed(SIGN_STREAM + seed)
    for scale, online in pairs:
        up, down = model.get_submodule(scale), model.get_submodule(online)
        signs = torch.randint(0, 2, (down.in_features,), generator=generator).mul_(2).sub_(1)
        replace_data(up.weight, up.weight.detach() * signs.to(up.weight).unsqueeze(1))
        if up.bias is not None:
            replace_data(up.bias, up.bias.detach() * signs.to(up.bias))
        replace_data(down.weight, down.weight.detach() * signs.to(down.weight))
    return [online for _, online in pairs]


# -- compressed-tensors' transform_config ---------------------------------------------------------

def transform_config(model: nn.Module) -> dict[str, Any] | None:
    """config.json's ``transform_config`` for the online rotations of ``model`` (``None`` without any),
    validated by compressed-tensors' own classes: per block size one ``hadamard`` scheme whose ``input``
    arguments are the online half and whose ``weight_input`` (inverse) arguments are already fused."""
    hooks = online_hadamards(model)
    if not hooks:
        return None
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    by_block: dict[tuple[int | None, torch.dtype], list[str]] = {}
    for name, hook in hooks.items():
        width = model.get_submodule(name).in_features
        by_block.setdefault((None if hook.block == width else hook.block, hook.precision), []).append(name)
    groups = {}
    for i, ((head_dim, precision), names) in enumerate(sorted(by_block.items(), key=lambda kv: (kv[0][0] or 0,
                                                                                                str(kv[0][1])))):
        groups[GROUP if i == 0 else f"{GROUP}_{i}"] = TransformScheme(
            type="hadamard", head_dim=head_dim, precision=precision,
            apply=[TransformArgs(targets=names, location="input"),
                   TransformArgs(targets=names, location="weight_input", inverse=True)])
    return TransformConfig(config_groups=groups).model_dump(mode="json")


def online_only(config: dict[str, Any]) -> Any:
    """``config`` (a ``transform_config`` dict) with its fused (weight) arguments left out: what
    compressed-tensors' ``apply_transform_config`` must apply to a loaded checkpoint, whose weights
    carry the fused half already. Returns a compressed-tensors ``TransformConfig``."""
    from compressed_tensors.transform import TransformConfig

    parsed = TransformConfig.model_validate(config)
    for scheme in parsed.config_groups.values():
        scheme.apply = [args for args in scheme.apply if args.is_online()]
    return parsed


def attach_from_transform_config(model: nn.Module, config: dict[str, Any]) -> list[str]:
    """Put the online rotations a saved ``transform_config`` declares back on ``model`` (loaded from the
    checkpoint, so the fused halves are in its weights already). Returns the rotated layers.

    Only what layerwise writes is regenerated here: deterministic ``hadamard`` schemes with online
    ``input`` arguments. Anything else is an error naming compressed-tensors' own ``apply_transform_config``.
    """
    from compressed_tensors.transform import TransformConfig

    parsed = TransformConfig.model_validate(config)
    plan: list[tuple[str, nn.Module, int, torch.dtype]] = []
    for group, scheme in parsed.config_groups.items():
        for args in scheme.apply:
            if not args.is_online():
                continue
            if scheme.type != "hadamard" or scheme.randomize or args.location != "input":
                raise OnlineRotationError(
                    f"transform_config group {group!r} ({scheme.type}, randomize={scheme.randomize}, location "
                    f"{args.location}) is not an online Hadamard of a Linear's input, the only transform layerwise "
                    f"regenerates; load the model with transformers and apply compressed_tensors.transform."
                    f"apply_transform_config(model, layerwise.algorithms.quantization.online_rotation.online_only("
                    f"config)) instead")
            layers = find_modules(model, args.targets, args.ignore)
            if not layers:
                raise OnlineRotationError(f"transform_config group {group!r} targets {args.targets}, which match no "
                                          f"module of {type(model).__name__}")
            for name, module in layers.items():
                try:
                    plan.append((name, module, check_block(module.in_features, scheme.head_dim), scheme.precision))
                except (HadamardSizeError, AttributeError) as exc:
                    raise OnlineRotationError(f"transform_config group {group!r} cannot rotate {name!r}: {exc}") \
                        from None
    for _, module, size, precision in plan:
        attach(module, size, precision)
    return [name for name, *_ in plan]
