"""Rotating a decoder's residual stream: an orthogonal ``Q`` folded into its weights (QuaRot / SpinQuant's R1).

In a pre-norm decoder every block reads the residual stream ``x`` through an RMSNorm and adds its
output back to it. Replace ``x`` by ``x Q`` everywhere, ``Q`` orthogonal, and the model computes the
same function when

* each RMSNorm's weight ``g`` is first folded into the Linears reading it (``W := W diag(g)``,
  ``g := 1``): a norm without weight commutes with ``Q`` (``rms(x Q) = rms(x)``);
* the token embeddings produce ``E Q``, every Linear reading the stream (after a norm) becomes
  ``W Q`` and every Linear writing to it (``o_proj``, ``down_proj``) becomes ``Q^T W`` (bias ``b Q``).

Nothing changes in the model's outputs (up to rounding), but the weights and activations the
quantizers then see are spread over all channels: a random Hadamard ``Q`` (``H diag(+-1) / sqrt(n)``)
removes outlier channels, which is what makes 4-bit activations (W4A8, W4A4) usable.

Where the stream is read and written is per-architecture knowledge: a :class:`RotationLayout`
(``ModelPatch.rotation_layout``; :data:`LLAMA_LIKE` when a patch declares none). Every norm is
probed before folding (its output must be ``g * f(x)`` with ``f`` unchanged by rotations: RMSNorm,
not LayerNorm) and a layout whose patterns match nothing is an error naming them; a family no folded rotation
keeps exact declares :func:`refused_layout` with the reason, which is the error.

Only rotations that fold into weights are made here; the online Hadamard before ``down_proj``
(QuaRot's R4), which must also run at inference, is :mod:`.online_rotation`, placed by the layout's
``online`` patterns.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from layerwise.algorithms.quantization.mappings import (
    Mapping,
    MappingError,
    ResolvedMapping,
    check_mappings,
    resolve_mappings,
)
from layerwise.algorithms.quantization.storage import replace_data
from layerwise.common.matching import find_modules, paired_by_parent, unmatched

KINDS = ("hadamard", "orthogonal")


class RotationError(MappingError):
    """A model the layout cannot rotate exactly (a pattern matching nothing, a norm that is not an RMSNorm)."""


@dataclass(frozen=True)
class RotationLayout:
    """Where a decoder's residual stream is read and written (patterns as in smoothing mappings)."""

    #: modules whose weight rows are stream vectors (token embeddings)
    embeddings: tuple[str, ...]
    #: ``((reader patterns...), norm pattern)``: each RMSNorm on the stream and the Linears reading it
    norms: tuple[Mapping, ...]
    #: Linears whose outputs are added to the stream
    writers: tuple[str, ...]
    #: Linears whose input cannot be rotated by folding (it comes out of a nonlinearity), rotated online
    #: instead when asked (``RotationModifier.online``): the MLP's ``down_proj``
    online: tuple[str, ...] = ()
    #: ``(value pattern, output pattern)``: the attention's ``v_proj`` and the ``o_proj`` reading its heads, for
    #: a Hadamard per head folded into both (SpinQuant's R2; ``RotationModifier.heads``)
    heads: tuple[str, ...] = ()
    #: ``(scale pattern, online pattern)``: the Linear whose output multiplies an online layer's input elementwise
    #: (the MLP's ``up_proj``) and that layer, for random signs folded into both, which make the online Hadamard a
    #: random one (``RotationModifier.online_signs``)
    online_signs: tuple[str, ...] = ()
    #: why the family's residual stream cannot be rotated exactly, for a layout that only says so
    #: (:func:`refused_layout`); empty for one to rotate by
    refusal: str = ""


def refused_layout(why: str) -> RotationLayout:
    """The layout of a family whose residual stream no folded rotation keeps exact (``why``): RotationModifier
    refuses it with that reason, instead of trying the Llama-like layout and naming what it misses."""
    return RotationLayout(embeddings=(), norms=(), writers=(), refusal=why)


def check_rotatable(model: torch.nn.Module, layout: RotationLayout, owner: str = "RotationModifier") -> None:
    """A refused layout, or a model without the head the rotation ends in, is an error giving its reason."""
    if layout.refusal:
        raise RotationError(f"{owner}: {type(model).__name__} cannot be rotated exactly: {layout.refusal}")
    if missing_head := _missing_head(model, layout):
        raise RotationError(
            f"{owner}: {type(model).__name__} has no language-model head for the rotation to end in (its rotation "
            f"layout ends the residual stream at {', '.join(map(repr, missing_head))}, which matches nothing, and "
            f"get_output_embeddings() is None). The rotation is undone where the head reads the final norm; without "
            f"a head the last hidden state would come out rotated. Compress the model with its head (loaded with "
            f"AutoModelForCausalLM rather than AutoModel; layerwise.load_model and --model pick the head from the "
            f"checkpoint), or leave {owner} out of the recipe")


def _missing_head(model: torch.nn.Module, layout: RotationLayout) -> list[str]:
    """The readers of a norm that match nothing (the head reading the final norm) in a model that has no output
    embeddings but whose embeddings and writers the layout finds: a base model (``LlamaModel``), not a layout
    that misnames its head or fits another family; ``[]`` otherwise."""
    output_embeddings = getattr(model, "get_output_embeddings", None)
    if not layout.norms or not callable(output_embeddings) or output_embeddings() is not None:
        return []
    if unmatched(model, (*layout.embeddings, *layout.writers)):
        return []
    for readers, _ in check_mappings(layout.norms, "rotation_layout", None):
        if unmatched(model, readers) == list(readers):
            return list(readers)
    return []


#: Llama, Mistral, Qwen2/3 and their kin: pre-norm blocks, a final norm before ``lm_head``
LLAMA_LIKE = RotationLayout(
    embeddings=("re:.*embed_tokens$",),
    norms=((("re:.*self_attn\\.q_proj$", "re:.*self_attn\\.k_proj$", "re:.*self_attn\\.v_proj$"),
            "re:.*input_layernorm$"),
           (("re:.*mlp\\.gate_proj$", "re:.*mlp\\.up_proj$"), "re:.*post_attention_layernorm$"),
           (("re:^lm_head$",), "re:^model\\.norm$")),
    writers=("re:.*self_attn\\.o_proj$", "re:.*mlp\\.down_proj$"),
    online=("re:.*mlp\\.down_proj$",),
    heads=("re:.*self_attn\\.v_proj$", "re:.*self_attn\\.o_proj$"),
    online_signs=("re:.*mlp\\.up_proj$", "re:.*mlp\\.down_proj$"),
)


@dataclass(frozen=True)
class ResolvedLayout:
    """A layout on one model: qualified names."""

    embeddings: tuple[str, ...]
    norms: tuple[ResolvedMapping, ...]
    writers: tuple[str, ...]

    @property
    def readers(self) -> tuple[str, ...]:
        return tuple(layer for mapping in self.norms for layer in mapping.balance)


def rotation_matrix(size: int, kind: str = "hadamard", seed: int = 0) -> Tensor:
    """A random ``size x size`` orthogonal matrix (float64): a Hadamard with random signs scaled by
    ``1 / sqrt(size)`` (compressed-tensors' ``random_hadamard_matrix`` for the same generator, bit for bit), or the
    ``Q`` of a Gaussian matrix's QR (signs fixed so it is uniform)."""
    generator = torch.Generator().manual_seed(seed)
    if kind == "hadamard":
        from layerwise.algorithms.quantization.hadamard import HadamardSizeError, known_hadamard

        signs = torch.randint(0, 2, (size,), generator=generator, dtype=torch.float64) * 2 - 1
        try:
            matrix = known_hadamard(size)
        except HadamardSizeError as exc:
            raise RotationError(f"no Hadamard matrix of size {size} is known ({exc}); use rotation: orthogonal") \
                from None
        return signs.unsqueeze(1) * matrix / math.sqrt(size)
    if kind == "orthogonal":
        q, r = torch.linalg.qr(torch.randn(size, size, generator=generator, dtype=torch.float64))
        return q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    raise RotationError(f"unknown rotation {kind!r}; valid rotations: {', '.join(KINDS)}")


def resolve_layout(model: torch.nn.Module, layout: RotationLayout, owner: str = "RotationModifier") -> ResolvedLayout:
    """The layout's modules on ``model``; a pattern matching nothing, or a norm with no reader, is an error."""
    check_rotatable(model, layout, owner)
    missing = unmatched(model, dict.fromkeys(_patterns(layout, owner)))
    if missing:
        shown = ", ".join(map(repr, missing[:4])) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise RotationError(f"{owner}: {shown} of the rotation layout match no module of "
                            f"{type(model).__name__}; declare rotation_layout in its model patch (GUIDE.md, "
                            f"'Rotations')")
    try:
        resolution = resolve_mappings(model, layout.norms, owner=owner)
    except MappingError as exc:
        raise RotationError(str(exc)) from None
    if resolution.skipped:
        name, why = resolution.skipped[0]
        raise RotationError(f"{owner}: norm {name!r} cannot be folded into its readers: {why}; every norm on the "
                            f"stream must be, or the rotation would not cancel")
    return ResolvedLayout(tuple(find_modules(model, layout.embeddings)), resolution.mappings,
                          tuple(find_modules(model, layout.writers)))


def _patterns(layout: RotationLayout, owner: str) -> list[str]:
    """Every pattern of the residual stream's layout, checked before the norms are resolved: a miss there is the
    layout's (the patch's), not a recipe's, and the error must say so."""
    norms = [p for balance, norm in check_mappings(layout.norms, owner, None) for p in (*balance, norm)]
    return [*layout.embeddings, *norms, *layout.writers]


@torch.no_grad()
def check_rms_norm(name: str, norm: torch.nn.Module, width: int) -> None:
    """The norm must compute ``g * f(x)`` with ``f`` unchanged by an orthogonal map (an RMSNorm)."""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 1 or getattr(norm, "bias", None) is not None:
        raise RotationError(f"{name!r} ({type(norm).__name__}) is not an RMSNorm with a weight and no bias; a "
                            f"rotation cannot pass through it")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, width, generator=generator, dtype=torch.float32).to(weight.device, weight.dtype) * 3 + 1
    q = _probe_rotation(width).to(weight.device, torch.float32)
    kept = weight.detach().clone()
    try:
        scaled = norm(x).float()
        weight.fill_(1.0)
        plain = norm(x).float()
        rotated = norm((x.float() @ q).to(x.dtype)).float()
    finally:
        weight.copy_(kept)
    tolerance = 1e-2 if weight.dtype in (torch.float16, torch.bfloat16) else 1e-4
    if not torch.allclose(scaled, plain * kept.float(), atol=tolerance, rtol=tolerance):
        raise RotationError(f"{name!r} ({type(norm).__name__}) does not scale its output by its weight (a weight "
                            f"offset such as Gemma's 1 + w?); it cannot be folded into its readers")
    if not torch.allclose(rotated, plain @ q, atol=tolerance * 10, rtol=tolerance * 10):
        raise RotationError(f"{name!r} ({type(norm).__name__}) does not commute with rotations (a LayerNorm "
                            f"subtracts the mean); only RMSNorm-style norms can be rotated through")


@functools.lru_cache(maxsize=4)
def _probe_rotation(width: int) -> Tensor:
    """The rotation every norm of one width is probed with (a QR per norm cost 10 ms at width 384)."""
    return rotation_matrix(width, "orthogonal", seed=1)


def _weight(model: torch.nn.Module, name: str) -> Tensor:
    module = model.get_submodule(name)
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise RotationError(f"{name!r} ({type(module).__name__}) has no 2-D weight to rotate")
    if type(module).__name__ == "Conv1D":
        raise RotationError(f"{name!r} is a transformers Conv1D; rotations handle nn.Linear and nn.Embedding")
    if weight.device.type == "meta":
        raise RotationError(f"{name!r} has no weights in memory (meta device); rotations need the model loaded")
    return weight


def untie_readers(model: torch.nn.Module, resolved: ResolvedLayout) -> list[str]:
    """Give every rotated Linear that shares its weight with an embedding (a tied ``lm_head``) its own copy:
    the norm folded into it must not reach the embedding. Returns the untied layers."""
    embedded = {id(_weight(model, name)) for name in resolved.embeddings}
    untied = []
    for name in (*resolved.readers, *resolved.writers):
        module = model.get_submodule(name)
        if id(module.weight) in embedded:
            module.weight = torch.nn.Parameter(module.weight.detach().clone(), requires_grad=False)
            untied.append(name)
    if untied:
        for config in (getattr(model, "config", None), _text_config(model)):
            if config is not None and getattr(config, "tie_word_embeddings", False):
                config.tie_word_embeddings = False
    return untied


def _text_config(model: torch.nn.Module):
    config = getattr(model, "config", None)
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else None


@torch.no_grad()
def fold_norms(model: torch.nn.Module, norms: Sequence[ResolvedMapping]) -> None:
    """Each norm's weight into the Linears reading it (``W := W diag(g)``), then ``g := 1``."""
    for mapping in norms:
        norm = model.get_submodule(mapping.smoothed)
        gain = norm.weight.detach().to(torch.float64)
        for layer in mapping.balance:
            weight = _weight(model, layer)
            replace_data(weight, (weight.to(torch.float64) * gain.to(weight.device)).to(weight.dtype))
        norm.weight.fill_(1.0)


@torch.no_grad()
def rotate(model: torch.nn.Module, resolved: ResolvedLayout, q: Tensor) -> None:
    """Rotate the stream by ``q``: embeddings and readers ``W Q``, writers ``Q^T W`` (bias ``b Q``); norms folded
    first (:func:`fold_norms`). Computed in float64, stored in each weight's dtype."""
    for name in resolved.embeddings:
        _right(_weight(model, name), q)
    for name in resolved.readers:
        _right(_weight(model, name), q)
    for name in resolved.writers:
        module = model.get_submodule(name)
        weight = _weight(model, name)
        qd = q.to(weight.device)
        replace_data(weight, (qd.t() @ weight.to(torch.float64)).to(weight.dtype))
        bias = getattr(module, "bias", None)
        if isinstance(bias, Tensor):
            replace_data(bias, (bias.to(torch.float64) @ qd).to(bias.dtype))


def _right(weight: Tensor, q: Tensor) -> None:
    if weight.shape[1] != q.shape[0]:
        raise RotationError(f"a weight of shape {tuple(weight.shape)} cannot be rotated by a {q.shape[0]}-wide "
                            f"rotation: the layout names a layer that does not read the residual stream")
    replace_data(weight, (weight.to(torch.float64) @ q.to(weight.device)).to(weight.dtype))


def rotate_residual_stream(model: torch.nn.Module, layout: RotationLayout, kind: str = "hadamard",
                           seed: int = 0, owner: str = "RotationModifier") -> ResolvedLayout:
    """Fold a random ``kind`` rotation of the residual stream into ``model`` (its function unchanged)."""
    resolved = resolve_layout(model, layout, owner)
    widths = {_weight(model, name).shape[1] for name in resolved.embeddings}
    if len(widths) != 1:
        raise RotationError(f"{owner}: the embeddings {list(resolved.embeddings)} differ in width ({sorted(widths)})")
    (width,) = widths
    for mapping in resolved.norms:
        check_rms_norm(mapping.smoothed, model.get_submodule(mapping.smoothed), width)
    untie_readers(model, resolved)
    fold_norms(model, resolved.norms)
    rotate(model, resolved, rotation_matrix(width, kind, seed))
    return resolved


def head_dim(model: torch.nn.Module) -> int:
    """The attention heads' width, from the (text) config: ``head_dim``, else hidden size / heads."""
    config = _text_config(model) or getattr(model, "config", None)
    width = getattr(config, "head_dim", None)
    if not width:
        heads = getattr(config, "num_attention_heads", None)
        hidden = getattr(config, "hidden_size", None)
        if not heads or not hidden:
            raise RotationError(f"{type(model).__name__}'s config gives no head_dim (nor hidden_size and "
                                f"num_attention_heads); per-head rotations need the heads' width")
        width = hidden // heads
    return int(width)


@torch.no_grad()
def rotate_heads(model: torch.nn.Module, patterns: Sequence[str], owner: str = "RotationModifier") -> list[str]:
    """Fold a Hadamard per attention head into ``v_proj`` (output side) and ``o_proj`` (input side), paired by
    their parent module: every head's values become ``v H``, ``o_proj`` reads ``u H`` and undoes it (exact, as
    attention mixes each head's value rows linearly). Returns the ``o_proj`` layers."""
    from layerwise.algorithms.quantization.hadamard import HadamardSizeError, check_block, fwht

    if len(patterns) != 2:
        raise RotationError(f"{owner}: rotation_layout.heads must be (value pattern, output pattern), got "
                            f"{tuple(patterns)}")
    pairs, values, outputs = paired_by_parent(model, *patterns)
    if pairs is None:
        raise RotationError(f"{owner}: rotation_layout.heads {tuple(patterns)} must match one value and one output "
                            f"projection per attention module of {type(model).__name__}; found values "
                            f"{values[:3]}... and outputs {outputs[:3]}...")
    width = head_dim(model)
    for v, o in pairs:
        for name, size in ((v, _weight(model, v).shape[0]), (o, _weight(model, o).shape[1])):
            try:
                check_block(size, width, f"the per-head rotation of {name!r}")
            except HadamardSizeError as exc:
                raise RotationError(f"{owner}: {exc}; per-head rotations need a power-of-two head_dim: leave "
                                    f"heads out") from None
    for v, o in pairs:
        value = model.get_submodule(v)
        weight = _weight(model, v)
        replace_data(weight, fwht(weight.to(torch.float64).t(), width).t().contiguous().to(weight.dtype))
        bias = getattr(value, "bias", None)
        if isinstance(bias, Tensor):
            replace_data(bias, fwht(bias.to(torch.float64), width).to(bias.dtype))
        out = _weight(model, o)
        replace_data(out, fwht(out.to(torch.float64), width).to(out.dtype))
    return [o for _, o in pairs]
