"""Rotations of the residual stream, folded into the weights before a quantizer (QuaRot / SpinQuant style).

``RotationModifier`` needs no data: when the run starts (``initialize``, before any modifier
observes or quantizes anything) it folds every RMSNorm's weight into the Linears reading it and
rotates the residual stream by a random orthogonal matrix (a Hadamard with random signs by default)
through the embeddings and every Linear reading or writing the stream
(:func:`~layerwise.algorithms.quantization.rotation.rotate_residual_stream`). The model's outputs are
unchanged; its weights and activations lose their outlier channels, so the quantizer listed after it
(GPTQ, RTN, AutoRound; W4A8 or W4A16) loses less. The model patch's ``rotation_layout`` says where the
stream is read and written (the Llama-like layout when it declares none), or why a family is refused
(Gemma3: no folded rotation keeps it exact), before anything is changed. A tied ``lm_head`` is
untied (the final norm is folded into it, not into the embeddings), and the saved config says so.

``online: true`` adds QuaRot's online Hadamard before every layer the layout lists as ``online``
(``down_proj``): folded into its weight, and run on its input at inference
(:mod:`~layerwise.algorithms.quantization.online_rotation`), before the quantizers calibrate, so
they see the rotated inputs. It is what 4-bit activations (W4A4) need; the saver writes it to
config.json as compressed-tensors' ``transform_config``. ``online_signs: true`` makes that Hadamard a
random one, as SpinQuant's ``random-hadamard`` R4 is: random signs folded into ``up_proj``'s rows and
``down_proj``'s columns first (the layout's ``online_signs``), nothing more to run at inference
(:func:`~layerwise.algorithms.quantization.online_rotation.flip_online_signs`). Off by default: on
tiny-llama-doc at W4A4 it moved neither the perplexity nor the KL beyond the seed-to-seed spread
(BENCHMARKS.md, "Rotation parity"). ``heads: true`` also folds a Hadamard per
attention head into ``v_proj`` and ``o_proj`` (SpinQuant's R2: ``o_proj``'s inputs spread out, nothing
online), where the layout declares ``heads``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from layerwise.plugin import CompressionState, Modifier, RecipeError, did_you_mean
from layerwise.plugin.quantization import (
    LLAMA_LIKE,
    OnlineRotationError,
    RotationError,
    check_rotatable,
    flip_online_signs,
    rotate_heads,
    rotate_inputs_online,
    rotate_residual_stream,
)


@dataclass
class RotationModifier(Modifier):
    """Rotate the residual stream by a random ``rotation`` (``hadamard`` or ``orthogonal``) drawn with ``seed``;
    with ``heads``, also each attention head's values by a Hadamard folded into ``v_proj`` and ``o_proj``; with
    ``online``, the inputs of the layout's online layers by a Hadamard (of ``block_size``, default their width)
    at run time, made random by ``online_signs`` folded into the layers feeding them (drawn with ``seed``)."""

    requires_data: ClassVar[bool] = False
    chained_presets: ClassVar[dict[str, tuple[tuple[str, dict[str, Any]], ...]]] = {
        "QUAROT_GPTQ_W4A8": (("RotationModifier", {}), ("GPTQModifier", {"scheme": "W4A8"})),
        "QUAROT_GPTQ_W4A16": (("RotationModifier", {}), ("GPTQModifier", {"scheme": "W4A16"})),
        "QUAROT_GPTQ_W4A4": (("RotationModifier", {"online": True}), ("GPTQModifier", {"scheme": "W4A4"})),
    }

    rotation: str = "hadamard"
    seed: int = 0
    online: bool = False
    block_size: int | None = None
    heads: bool = False
    online_signs: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rotation not in ("hadamard", "orthogonal"):
            raise RecipeError(f"unknown RotationModifier.rotation {self.rotation!r};"
                              f"{did_you_mean(self.rotation, ('hadamard', 'orthogonal'))} valid rotations: hadamard, "
                              f"orthogonal")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise RecipeError(f"RotationModifier.seed must be an integer, got {self.seed!r}")
        for flag in ("online", "heads", "online_signs"):
            if not isinstance(getattr(self, flag), bool):
                raise RecipeError(f"RotationModifier.{flag} must be true or false, got {getattr(self, flag)!r}")
        if self.block_size is not None and (isinstance(self.block_size, bool) or not isinstance(self.block_size, int)
                                            or self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise RecipeError(f"RotationModifier.block_size must be a power of two (or left out for the layer's "
                              f"width), got {self.block_size!r}")
        if self.block_size is not None and not self.online:
            raise RecipeError("RotationModifier.block_size sizes the online rotation; set online: true with it")
        #: the rotated modules, by role (qualified names), once applied
        self.rotated: dict[str, list[str]] = {}

    def on_initialize(self, state: CompressionState) -> None:
        patch = state.model_patch
        layout = getattr(patch, "rotation_layout", None) or LLAMA_LIKE
        owner = type(self).__name__
        check_rotatable(state.model, layout, owner)
        if self.online and not layout.online:
            raise RotationError(f"{owner}.online: the rotation layout of {type(state.model).__name__} names no layer "
                                f"to rotate online; declare rotation_layout.online in its model patch (GUIDE.md, "
                                f"'Rotations') or leave online out")
        try:
            resolved = rotate_residual_stream(state.model, layout, self.rotation, self.seed, owner=owner)
        except RotationError as exc:
            if getattr(patch, "rotation_layout", None) is not None:
                raise
            raise RotationError(f"{exc} ({_no_layout(patch, state.model)})") from None
        self.rotated = {"embeddings": list(resolved.embeddings), "norms": [m.smoothed for m in resolved.norms],
                        "readers": list(resolved.readers), "writers": list(resolved.writers)}
        if self.heads:
            if not layout.heads:
                raise RotationError(f"{owner}.heads: the rotation layout of {type(state.model).__name__} names no "
                                    f"value / output projections; declare rotation_layout.heads in its model patch "
                                    f"or leave heads out")
            self.rotated["heads"] = rotate_heads(state.model, layout.heads, owner)
        if self.online:
            try:
                if self.online_signs and layout.online_signs:
                    self.rotated["online_signs"] = flip_online_signs(state.model, layout.online_signs, self.seed,
                                                                     owner)
                self.rotated["online"] = rotate_inputs_online(state.model, layout.online, self.block_size, owner)
            except OnlineRotationError as exc:
                raise RotationError(str(exc)) from None
        state.log.append({"modifier": type(self).__name__, "name": "residual stream", "rotation": self.rotation,
                          "seed": self.seed, **{k: len(v) for k, v in self.rotated.items()}})


def _no_layout(patch: Any, model: Any) -> str:
    """Why the Llama-like layout was tried: the fix is the patch's (a ``rotation_layout``), not the recipe's."""
    whose = f"the model patch {patch.name!r} declares none" if patch is not None else \
        f"no model patch matches {type(model).__name__}"
    return f"{whose}, so the Llama-like default layout was tried"
