"""The FP8 KV cache (and FP8 attention): which settings exist, the scales, and the values attention computes with.

A server with an FP8 KV cache (vLLM ``--kv-cache-dtype fp8``) stores each key and value as float8 E4M3
after the rotary embedding, ``q = fp8(k / k_scale)``, and attention reads ``q * k_scale``; with FP8
attention the queries are quantized the same way (``q_scale``). The scales are static, calibrated once::

    k_scale = amax(keys) / 448        (448: the largest E4M3 value)

so the largest key seen in calibration lands on E4M3's largest value and nothing seen saturates.
``strategy: tensor`` keeps one scale per attention layer (shape ``(1,)``); ``strategy: attn_head`` one per
key/value head (shape ``(heads, 1, 1)``, broadcasting over ``(batch, heads, tokens, head_dim)``), which
protects heads with small ranges from a neighbour's outliers. Shapes and names are compressed-tensors'
(``QuantizationStrategy.ATTN_HEAD``, ``k_scale`` / ``v_scale`` / ``q_scale`` on the attention module).

Keys and values have the layout ``(batch, heads, tokens, head_dim)`` transformers' attention functions take.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from layerwise.algorithms.quantization.args import QuantizationArgs
from layerwise.algorithms.quantization.qmath import FP8_MAX, fake_quantize
from layerwise.errors import RecipeError, unknown_names

#: one scale per attention layer, or one per head
KV_STRATEGIES = ("tensor", "attn_head")
#: the fields a kv_cache_scheme may give (compressed-tensors' QuantizationArgs names)
KV_FIELDS = ("num_bits", "type", "symmetric", "strategy", "dynamic", "observer", "group_size", "actorder",
             "block_structure", "scale_dtype", "zp_dtype", "observer_kwargs")
#: compressed-tensors' observer names read as the widest range seen (llm-compressor's ``minmax`` moves its range
#: by a constant per batch; the KV scales here are always the widest range, so nothing seen saturates)
WIDEST_RANGE = ("minmax", "static_minmax", "memoryless_minmax", "memoryless")
#: the E4M3 KV cache with one scale per layer (llm-compressor's usual kv_cache_scheme)
FP8_KV = QuantizationArgs(type="float", num_bits=8, symmetric=True, strategy="tensor", group_size=None)


def kv_cache_args(value: Any, where: str = "kv_cache_scheme") -> QuantizationArgs | None:
    """The KV cache's args from a recipe value: ``None``; ``"fp8"`` / ``"fp8_head"``; a mapping of
    compressed-tensors' QuantizationArgs fields; or an args object. Anything but static, symmetric FP8
    E4M3 per tensor or per head is an error naming ``where`` and what to write."""
    if value is None:
        return None
    if isinstance(value, str):
        named = {"fp8": FP8_KV, "fp8_head": FP8_KV.replace(strategy="attn_head")}
        if value.lower() not in named:
            raise RecipeError(f"{where}: unknown name {value!r}; give 'fp8' (one scale per layer), 'fp8_head' "
                              f"(one per head) or a mapping {{num_bits: 8, type: float, strategy: tensor}}")
        return named[value.lower()]
    if hasattr(value, "model_dump"):  # compressed-tensors' QuantizationArgs
        value = value.model_dump(mode="json")
    if isinstance(value, QuantizationArgs):
        args = value
    elif isinstance(value, dict):
        unknown = [k for k in value if k not in KV_FIELDS]
        if unknown:
            raise RecipeError(f"{where}: unknown field(s) {unknown_names(unknown, KV_FIELDS)}; valid fields: "
                              f"num_bits, type, symmetric, strategy, dynamic, observer")
        data = {k: v for k, v in value.items() if k in ("num_bits", "type", "symmetric", "strategy", "dynamic",
                                                        "observer") and v is not None}
        if data.get("observer") in WIDEST_RANGE:
            data["observer"] = "minmax"
        data.setdefault("strategy", "tensor")
        data.setdefault("type", "float" if data.get("num_bits", 8) == 8 else "int")
        data.setdefault("num_bits", 8)
        _check_fields({"symmetric": True, "dynamic": False, "observer": "minmax", **data}, where)
        try:
            args = QuantizationArgs.from_dict(data)
        except RecipeError as exc:
            raise RecipeError(f"{where}: {exc}") from None
    else:
        raise RecipeError(f"{where} must be 'fp8', 'fp8_head' or a mapping of quantization fields, "
                          f"not {type(value).__name__}")
    check_kv_args(args, where)
    return args


def check_kv_args(args: QuantizationArgs, where: str = "kv_cache_scheme") -> None:
    """Refuse what vLLM's FP8 KV cache does not serve: anything but static, symmetric FP8 E4M3 per tensor or head."""
    _check_fields({name: getattr(args, name) for name in ("type", "num_bits", "dynamic", "symmetric", "strategy",
                                                          "observer")}, where)


def _check_fields(fields: dict[str, Any], where: str) -> None:
    if fields["type"] != "float" or fields["num_bits"] != 8:
        raise RecipeError(f"{where}: the KV cache is stored as FP8 E4M3 (type: float, num_bits: 8); got type "
                          f"{fields['type']!r}, num_bits {fields['num_bits']} (vLLM serves no integer KV cache scales)")
    if fields["dynamic"] is not False:
        raise RecipeError(f"{where}: dynamic: {fields['dynamic']!r} is not served: the KV cache scales are static, "
                          f"calibrated on the data and stored as k_scale / v_scale; set dynamic: false")
    if fields["symmetric"] is not True:
        raise RecipeError(f"{where}: symmetric: {fields['symmetric']!r} is not served (vLLM's FP8 KV cache has no "
                          f"zero point); set symmetric: true")
    if fields["strategy"] not in KV_STRATEGIES:
        raise RecipeError(f"{where}: strategy {fields['strategy']!r} is not a KV cache strategy; valid: "
                          f"{', '.join(KV_STRATEGIES)} (one scale per attention layer or per head)")
    if fields["observer"] != "minmax":
        raise RecipeError(f"{where}: observer {fields['observer']!r}: the KV scales come from the largest magnitude "
                          f"seen (minmax), so nothing seen saturates; leave observer out")


def kv_amax(x: Tensor, strategy: str) -> Tensor:
    """The largest magnitude of keys / values / queries ``x`` ``(batch, heads, tokens, head_dim)``: shape ``(1,)``
    for ``tensor``, ``(heads, 1, 1)`` for ``attn_head``; float32."""
    if x.ndim != 4:
        raise ValueError(f"attention states have 4 dimensions (batch, heads, tokens, head_dim), got {tuple(x.shape)}")
    magnitude = x.detach().abs()
    if strategy == "attn_head":
        return magnitude.amax(dim=(0, 2, 3)).to(torch.float32).reshape(-1, 1, 1)
    return magnitude.amax().to(torch.float32).reshape(1)


def kv_scale(amax: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``amax / 448`` in ``dtype`` (how it is stored: compressed-tensors keeps the model's dtype); an all-zero
    range gets the dtype's machine epsilon (any positive scale decodes zeros)."""
    scale = (amax.to(torch.float32) / FP8_MAX).to(dtype)
    return torch.where(scale == 0, torch.full_like(scale, torch.finfo(dtype).eps), scale)


def fake_quantize_kv(x: Tensor, scale: Tensor, args: QuantizationArgs) -> Tensor:
    """The values attention computes with when ``x`` ``(batch, heads, tokens, head_dim)`` is stored as FP8 with
    ``scale`` (``(1,)`` or ``(heads, 1, 1)``): ``fp8(clamp(x / scale, +-448)) * scale``, in ``x``'s dtype."""
    scale = scale.to(device=x.device, dtype=torch.float32)
    if scale.numel() > 1 and (x.ndim != 4 or scale.shape[0] != x.shape[1]):
        raise ValueError(f"per-head scales {tuple(scale.shape)} do not match {x.shape[1]} heads of {tuple(x.shape)}")
    return fake_quantize(x.detach().to(torch.float32), scale, None, args).to(x.dtype)  # rounding has no gradient
