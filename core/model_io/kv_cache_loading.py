"""Loading a folder with an FP8 KV cache (``quantization_config.kv_cache_scheme``, ``<attn>.k_scale`` / ``v_scale``).

compressed-tensors 0.20 applies the scheme on load only to attention modules whose ``forward`` takes
``past_key_values`` (or ``past_key_value``); transformers 5.24 renamed that argument ``cache``, so with
these two versions plain ``from_pretrained`` reports the scales as unexpected keys and runs the model with an
unquantized cache (its weights are right). transformers 5.17 with compressed-tensors 0.19 applies it
(measured in ``bench/kv_cache_bench.py``). :func:`load_compressed` therefore loads such a folder with the
scale names expected, then attaches layerwise's own KV quantization (the hook of
:mod:`layerwise.algorithms.quantization.attention`) with the stored scales, unless compressed-tensors
already gave the attention modules their ``k_scale`` parameters; the model then computes what the
in-memory model did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from layerwise.algorithms.quantization.attention import find_attention_modules, set_attention_scales
from layerwise.algorithms.quantization.kv_cache import kv_cache_args
from layerwise.model_io.checkpoint_tensors import prefixed_names

#: the attention scales compressed-tensors stores, as the regex transformers matches key names with
SCALE_KEYS = r"\.(k|v|q)_scale$"


def kv_cache_scheme(quant: dict[str, Any]) -> dict[str, Any] | None:
    """The ``kv_cache_scheme`` of a ``quantization_config`` dict, if it has one."""
    scheme = quant.get("kv_cache_scheme")
    return scheme if isinstance(scheme, dict) and scheme else None


def attention_scheme(quant: dict[str, Any]) -> dict[str, Any] | None:
    """The queries' args of FP8 attention: a config group with ``input_activations`` and no weights."""
    for group in (quant.get("config_groups") or {}).values():
        if isinstance(group, dict) and group.get("weights") is None and group.get("input_activations"):
            return group["input_activations"]
    return None


@contextlib.contextmanager
def scales_expected(cls: type) -> Iterator[None]:
    """While loading ``cls``, the attention scales are not reported as unexpected (layerwise attaches them)."""
    before = cls.__dict__.get("_keys_to_ignore_on_load_unexpected", None)
    had = "_keys_to_ignore_on_load_unexpected" in cls.__dict__
    inherited = getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or []
    cls._keys_to_ignore_on_load_unexpected = [*inherited, SCALE_KEYS]
    try:
        yield
    finally:
        if had:
            cls._keys_to_ignore_on_load_unexpected = before
        else:
            del cls._keys_to_ignore_on_load_unexpected


@torch.no_grad()
def attach_kv_scales(model: torch.nn.Module, files: list[Path], quant: dict[str, Any]) -> list[str]:
    """Give each attention layer of ``model`` the ``k_scale`` / ``v_scale`` of the safetensors ``files`` and
    quantize its keys and values with them; nothing when compressed-tensors did already. Returns the layers set."""
    from safetensors import safe_open

    scheme = kv_cache_scheme(quant)
    if scheme is None:
        return []
    modules = find_attention_modules(model)
    if any(isinstance(getattr(m, "k_scale", None), torch.nn.Parameter) for m in modules.values()):
        return []  # compressed-tensors applied the scheme itself
    args = kv_cache_args(scheme, "quantization_config.kv_cache_scheme")
    queries = attention_scheme(quant)
    query_args = None if queries is None else kv_cache_args(queries, "quantization_config.config_groups")
    prefix = getattr(model, "base_model_prefix", "")
    done = []
    for file in files:
        with safe_open(str(file), "pt") as tensors:
            keys = set(tensors.keys())
            for key in sorted(k for k in keys if k.endswith(".k_scale")):
                stem = key.removesuffix(".k_scale")
                name = next((c for c in prefixed_names(stem, prefix) if c in modules), None)
                if name is None or f"{stem}.v_scale" not in keys:
                    continue
                scales = {"k_scale": tensors.get_tensor(key), "v_scale": tensors.get_tensor(f"{stem}.v_scale")}
                asked = query_args is not None and f"{stem}.q_scale" in keys
                if asked:
                    scales["q_scale"] = tensors.get_tensor(f"{stem}.q_scale")
                set_attention_scales(modules[name], scales, args, query_args if asked else None)
                done.append(name)
    return done
